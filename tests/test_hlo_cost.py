"""grpo_core.rl.hlo_cost, the compiled module's bytes and FLOPs with its loops counted, and
bench.decode_bytes's ratio of a decode token step's bytes to its floor, kept here on a small
shape: on the local backend and on a TPU chip through XLA's TPU compiler (libtpu, installed by
the dev install; nothing runs on a TPU)."""

import os

import jax
import jax.numpy as jnp
import pytest

from grpo_core.rl import hlo_cost


def _compiled(f, *args):
    return jax.jit(f).lower(*args).compile()


def _xla(compiled) -> dict:
    ca = compiled.cost_analysis()
    return (ca[0] if isinstance(ca, (list, tuple)) else ca) or {}


def test_a_loop_counts_as_often_as_it_runs():
    """A 7-step fori_loop of a (64, 128) @ (128, 256) matmul: 7 matmuls here, one in XLA's own
    cost_analysis(); with every loop once, this reader gives XLA's figures."""
    x = jnp.ones((64, 128), jnp.float32)
    w = jnp.ones((7, 128, 256), jnp.float32)

    def f(x, w):
        def body(i, acc):
            return acc + (x @ w[i]).sum()

        return jax.lax.fori_loop(0, 7, body, jnp.float32(0))

    compiled = _compiled(f, x, w)
    text = compiled.as_text()
    a = hlo_cost.analyse(text)
    one = 2 * 64 * 128 * 256
    assert a.per_iteration is None and list(a.loops.values()) == [7]
    assert 7 * one <= a.once.flops <= 7 * one * 1.05, a.once.flops
    assert 7 * 128 * 256 * 4 <= a.once.bytes  # each step reads its (128, 256) slice of w
    flat, xla = hlo_cost.once_each(text), _xla(compiled)
    assert flat.flops == pytest.approx(xla["flops"], rel=0.05)
    assert flat.bytes == pytest.approx(xla["bytes accessed"], rel=0.1)


def test_a_loop_the_data_decides_is_reported_per_iteration():
    """A while loop that stops on a value: its body's cost is one iteration's, apart from the
    cost outside it."""

    def f(x):
        return jax.lax.while_loop(lambda c: c[1] < c[0].sum(), lambda c: (c[0] @ c[0], c[1] + 1), (x, 0))[0]

    a = hlo_cost.analyse(_compiled(f, jnp.ones((96, 96), jnp.float32)).as_text())
    assert len(a.iterations) == 1 and a.per_iteration is a.iterations[0]
    assert a.per_iteration.flops >= 2 * 96**3 and a.once.flops < 2 * 96**3


@pytest.fixture(scope="module")
def decode_bytes():
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu as a compiler only
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    from bench import decode_bytes

    return decode_bytes


def test_decode_step_bytes_near_the_floor_on_a_tpu_chip(decode_bytes):
    """The small shape on one v5e chip, compiled by XLA's TPU compiler: a token step moves at most
    1.7x the weights + the live KV cache (1.58x at this change; 3.56x before it, when the layer
    loop wrote the cache; 1.35x at Qwen2.5-0.5B's shape, docs/benchmarks.md), and at least them."""
    r = decode_bytes.measure("small", "v5e:1x1")
    assert r["decode_loops"] == 4  # the decode loop's phases on a TPU (sampler.backend_defaults)
    assert 1.0 <= r["x_floor"] <= 1.7, r
    assert r["step_bytes"] >= r["weights_bytes"]


def test_decode_step_bytes_on_the_local_backend(decode_bytes):
    """The same shape on this CPU in float32 (the dtype a CPU computes in), its layers as straight
    code over weights and a cache laid out per layer: at most 1.6x the floor (1.38x at this
    change, 1.48x at Qwen2.5-0.5B's shape; a loop over the stacked layers, whose slices XLA:CPU
    copies before each matmul, made it 3.5x, and a copy of the whole cache per layer 10.9x)."""
    r = decode_bytes.measure("small", "local", "float32")
    assert r["layers_unrolled"] and r["decode_loops"] == 1 and 1.0 <= r["x_floor"] <= 1.6, r
    table = decode_bytes.table([r])
    assert "x floor" in table and "the ops that move the most per token step" in table
