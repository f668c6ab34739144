"""Attention through jax.nn.dot_product_attention (model.attend) against the written-out formula
it replaced: values and gradients, GQA, left padding, f32 and bf16; and the implementation choice."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_core.errors import ConfigError
from grpo_core.nn.model import attend, attention_impl, causal_inputs


def written_out(q, k, v, mask):
    """einsum -> f32 softmax -> einsum, K/V shared by G query heads (the formula before)."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32)
    s = jnp.where(mask[:, None, None], s / math.sqrt(d), -1e30)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(b, t, h, d)


def inputs(dtype, b=3, t=7, heads=4, kv=2, d=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, t, heads, d), dtype)
    k = jax.random.normal(ks[1], (b, t, kv, d), dtype)
    v = jax.random.normal(ks[2], (b, t, kv, d), dtype)
    valid = np.ones((b, t), bool)
    valid[1, :3] = False  # left padding
    valid[2, :6] = False
    _, mask = causal_inputs(jnp.asarray(valid))
    return q, k, v, mask


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv", [(4, 2), (4, 4), (6, 1)])
def test_values_and_gradients_equal_the_written_out_formula(dtype, tol, heads, kv):
    q, k, v, mask = inputs(dtype, heads=heads, kv=kv)
    # jitted, as the model runs it: op by op, every primitive of both formulas and of their
    # gradients is a program of its own to compile (~60 CPU-s for this test's six cases)
    out, ref = jax.jit(attend)(q, k, v, mask), jax.jit(written_out)(q, k, v, mask)
    assert out.dtype == q.dtype and out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)

    w = jax.random.normal(jax.random.key(9), q.shape, jnp.float32)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, mask).astype(jnp.float32) * w)
    got, want = (jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(q, k, v) for f in (attend, written_out))
    for name, g, r in zip("qkv", got, want):
        scale = float(jnp.max(jnp.abs(r.astype(jnp.float32))))
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(r, np.float32), atol=tol * max(scale, 1.0), err_msg=f"d{name}"
        )


def test_padding_keys_get_no_weight():
    """A key the mask hides changes nothing, whatever it holds."""
    q, k, v, mask = inputs(jnp.float32)
    k2 = k.at[2, :6].set(1e3)
    v2 = v.at[2, :6].set(-1e3)
    np.testing.assert_allclose(attend(q, k, v, mask)[2, 6:], attend(q, k2, v2, mask)[2, 6:], atol=1e-6)


def test_implementation_choice(monkeypatch):
    monkeypatch.delenv("GRPO_ATTENTION", raising=False)
    assert attention_impl(8, jnp.float32) == "xla"
    assert attention_impl(1, jnp.bfloat16) == "xla"
    # cuDNN's only where there is a GPU: not on this backend
    assert attention_impl(8, jnp.bfloat16) == ("cudnn" if jax.default_backend() == "gpu" else "xla")
    monkeypatch.setenv("GRPO_ATTENTION", "xla")
    assert attention_impl(8, jnp.bfloat16) == "xla"
    monkeypatch.setenv("GRPO_ATTENTION", "flash")
    with pytest.raises(ConfigError, match="GRPO_ATTENTION='flash'"):
        attention_impl(8, jnp.bfloat16)
