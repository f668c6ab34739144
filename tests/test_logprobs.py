"""Chunked log-probs and entropy (grpo_core.rl.logprobs) equal the plain log-softmax formula in
value and gradient, on raw tensors and through whole models (tied and untied heads, T != 1,
LoRA); every remat policy gives the same update; and no value of the learner's program is as
large as one (rows, tokens, vocab) logits tensor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_core.config.presets import get_preset
from grpo_core.config.train import GRPOConfig, OptimizerConfig, RematPolicy
from grpo_core.nn import lora
from grpo_core.nn.model import create_model
from grpo_core.rl.learner import Learner, LossParams, completion_logprobs
from grpo_core.rl.logprobs import num_chunks, token_logprobs
from grpo_core.rl.types import Batch


def plain(h, w, targets, temperature, vocab_major):
    """The formula the chunks must reproduce: log_softmax of all logits, then the target's entry."""
    z = (h @ (w.T if vocab_major else w)) / temperature
    lp = jax.nn.log_softmax(z, axis=-1)
    return jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0], -jnp.sum(jnp.exp(lp) * lp, axis=-1)


def grads(f, h, w):
    """d f / d (h, w), jitted: op by op, every primitive of a formula and of its gradient is a
    program of its own to compile, for each of the cases' shapes."""
    return jax.jit(jax.grad(f, argnums=(0, 1)))(h, w)


def mib_for(chunks: int, tokens: int, vocab: int) -> float:
    """The train.logits_chunk_mib that asks for this many vocabulary chunks."""
    return tokens * vocab * 4 / chunks / 2**20


@pytest.mark.parametrize("vocab_major", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab, chunks", [(50, 1), (50, 5), (53, 3), (53, 7), (53, 53)])  # 53 is prime: padded
def test_values_and_gradients_equal_the_plain_formula(vocab_major, temperature, vocab, chunks):
    k = jax.random.split(jax.random.key(0), 5)
    b, n, e = 3, 7, 16
    h = jax.random.normal(k[0], (b, n, e))
    w = 0.3 * jax.random.normal(k[1], (vocab, e) if vocab_major else (e, vocab))
    t = jax.random.randint(k[2], (b, n), 0, vocab)
    g_lp, g_ent = jax.random.normal(k[3], (b, n)), jax.random.normal(k[4], (b, n))

    def objective(fn):
        def f(h, w):
            lp, ent = fn(h, w)
            return jnp.sum(lp * g_lp) + jnp.sum(ent * g_ent)

        return f

    assert num_chunks(vocab, b * n, mib_for(chunks, b * n, vocab)) == chunks
    ours = lambda h, w: token_logprobs(
        h, w, t, temperature=temperature, chunk_mib=mib_for(chunks, b * n, vocab), vocab_major=vocab_major
    )
    ref = lambda h, w: plain(h, w, t, temperature, vocab_major)
    for a, c in zip(jax.jit(ref)(h, w), jax.jit(ours)(h, w)):  # each side jitted (see `grads`)
        np.testing.assert_allclose(c, a, atol=1e-5)
    for a, c in zip(grads(objective(ref), h, w), grads(objective(ours), h, w)):
        np.testing.assert_allclose(c, a, atol=1e-5, rtol=1e-5)
    # the entropy as a metric only (its cotangent a symbolic zero): the log-prob gradient is unchanged
    only_lp = lambda fn: lambda h, w: jnp.sum(fn(h, w)[0] * g_lp) + jnp.sum(jax.lax.stop_gradient(fn(h, w)[1]))
    for a, c in zip(grads(only_lp(ref), h, w), grads(only_lp(ours), h, w)):
        np.testing.assert_allclose(c, a, atol=1e-5, rtol=1e-5)


def test_a_frozen_head_gets_no_gradient():
    h, w = jnp.ones((2, 4, 8)), jnp.ones((8, 20))
    t = jnp.zeros((2, 4), jnp.int32)
    gh, gw = jax.grad(
        lambda h, w: jnp.sum(token_logprobs(h, w, t, chunk_mib=mib_for(4, 8, 20), vocab_major=False, w_grad=False)[0]),
        argnums=(0, 1),
    )(h, w)
    assert float(jnp.abs(gw).max()) == 0.0 and gh.shape == h.shape


def test_chunks_keep_a_chunk_within_its_budget():
    k = num_chunks(151936, 4096, 64)
    assert 151936 % k == 0 and 151936 // k * 4096 * 4 <= 64 * 2**20  # a divisor: no padding
    assert num_chunks(384, 4096, 64) == 1  # small vocabularies: one chunk


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_on_an_accelerator_the_count_is_a_power_of_two_that_divides_the_vocabulary(backend):
    qwen = 151936  # 2^7 x 1187
    assert num_chunks(qwen, 16384, 64) == 149  # CPU: the least within budget, the head padded by 3 words
    assert num_chunks(qwen, 16384, 64, backend) == 128  # 16 % over budget, unpadded
    assert num_chunks(qwen, 8192, 64, backend) == 128  # within budget: the least power of two (75 -> 128)
    assert num_chunks(qwen, 2048, 64, backend) == 32
    # least 594: 128 chunks would be 4.6x over budget, so the CPU rule (a divisor up to twice the least)
    assert num_chunks(qwen, 65536, 64) == 1187 and num_chunks(qwen, 65536, 64, backend) == 1187
    assert num_chunks(128256, 32768, 64, backend) == 256  # Llama 3's 2^8 x 501
    assert num_chunks(50257, 16384, 64, backend) == num_chunks(50257, 16384, 64)  # odd: the CPU rule
    assert num_chunks(384, 4096, 64, backend) == 1


def test_a_power_of_two_count_gives_the_plain_values_and_gradients():
    """The accelerator's count (16 unpadded chunks of 37 words) where the CPU's pads (17 of 35)."""
    b, n, e, vocab = 2, 5, 16, 592  # 2^4 x 37
    mib = mib_for(17, b * n, vocab)
    assert (num_chunks(vocab, b * n, mib), num_chunks(vocab, b * n, mib, "tpu")) == (17, 16)
    k = jax.random.split(jax.random.key(1), 3)
    h, w = jax.random.normal(k[0], (b, n, e)), 0.3 * jax.random.normal(k[1], (vocab, e))
    t = jax.random.randint(k[2], (b, n), 0, vocab)
    loss = lambda fn: lambda h, w: jnp.sum(fn(h, w)[0]) + 0.5 * jnp.sum(fn(h, w)[1])
    ours = lambda h, w: token_logprobs(h, w, t, chunk_mib=mib, vocab_major=True, backend="tpu")
    ref = lambda h, w: plain(h, w, t, 1.0, True)
    for a, c in zip(jax.jit(ref)(h, w), jax.jit(ours)(h, w)):
        np.testing.assert_allclose(c, a, atol=1e-5)
    for a, c in zip(grads(loss(ref), h, w), grads(loss(ours), h, w)):
        np.testing.assert_allclose(c, a, atol=1e-5, rtol=1e-5)


def batch(p=2, g=3, tp=5, n=6, vocab=384, seed=0):
    rng = np.random.default_rng(seed)
    valid = np.ones((p, tp), bool)
    valid[0, :2] = False  # left padding
    return (
        jnp.asarray(rng.integers(1, vocab, (p, tp)), jnp.int32),
        jnp.asarray(valid),
        jnp.asarray(rng.integers(1, vocab, (p * g, n)), jnp.int32),
    )


def model_plain(model, ptok, pval, targets, temperature):
    """The whole (B, N, V) logits of the model's head, then the plain formula."""
    z = model.logits(model.hidden_states_grouped(ptok, pval, targets[:, :-1])) / temperature
    lp = jax.nn.log_softmax(z, axis=-1)
    return jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0], -jnp.sum(jnp.exp(lp) * lp, axis=-1)


@pytest.mark.parametrize("tied, with_lora", [(True, False), (False, True)])  # each head kind, LoRA once
def test_through_the_model_with_tied_and_untied_heads_and_lora(tied, with_lora):
    model = create_model(get_preset("tiny", tie_word_embeddings=tied), 0)
    ptok, pval, targets = batch()
    if with_lora:  # the gradient is the adapters' (perturbed: B no longer zero); the head is frozen
        lora.apply(model, lora.LoraConfig(rank=4))
        graphdef, adapters, base = nnx.split(model, nnx.LoRAParam, ...)
        params = jax.tree.map(lambda x: x + 0.05, adapters)
        merge = lambda p: nnx.merge(graphdef, base, p)
    else:
        graphdef, params = nnx.split(model)
        merge = lambda p: nnx.merge(graphdef, p)
    weights = jax.random.normal(jax.random.key(1), targets.shape)

    def loss(p, fn):
        lp, ent = fn(merge(p))
        return jnp.sum(lp * weights) + 0.1 * jnp.sum(ent)

    ours = lambda m: completion_logprobs(
        m, ptok, pval, targets, 0.8, chunk_mib=mib_for(5, targets.size, 384), head_grad=not with_lora
    )
    ref = lambda m: model_plain(m, ptok, pval, targets, 0.8)
    for a, c in zip(jax.jit(lambda p: ref(merge(p)))(params), jax.jit(lambda p: ours(merge(p)))(params)):
        np.testing.assert_allclose(c, a, atol=1e-5)
    grad = jax.jit(jax.grad(loss), static_argnums=1)  # jitted: op by op costs more than compiling
    ga, gc = grad(params, ref), grad(params, ours)
    jax.tree.map(lambda a, c: np.testing.assert_allclose(c, a, atol=1e-5, rtol=1e-4), ga, gc)


def learner_inputs(vocab=384, n=12):
    model = create_model(get_preset("tiny", vocab_size=vocab), 0)
    graphdef, params = nnx.split(model)
    ptok, pval, targets = batch(p=4, g=4, tp=8, n=n, vocab=vocab)
    b, n = targets.shape
    rng = np.random.default_rng(3)
    data = Batch(
        prompt_tokens=ptok,
        prompt_valid=pval,
        targets=targets,
        mask=jnp.ones((b, n), jnp.float32),
        old_logp=jnp.asarray(-rng.uniform(1, 8, (b, n)), jnp.float32),
        ref_logp=jnp.asarray(-rng.uniform(1, 8, (b, n)), jnp.float32),
        advantages=jnp.asarray(rng.normal(size=b), jnp.float32),
    )
    return graphdef, params, data


def update(graphdef, params, data, remat, chunk=64, accum=1):
    hp = LossParams.from_config(
        GRPOConfig(beta=0.04, grad_accum_steps=accum, prompts_per_step=4, num_generations=4),
        data.targets.shape[1],
        0.9,
        remat,
        chunk,
    )
    learner = Learner(graphdef, OptimizerConfig(learning_rate=1e-3, eps=1e-3), hp, 10)
    state, metrics = learner.update(learner.init_state(jax.tree.map(jnp.copy, params)), data)
    return state["params"], metrics


def test_every_remat_policy_gives_the_same_update():
    graphdef, params, data = learner_inputs()
    base_p, base_m = update(graphdef, params, data, RematPolicy.NONE)
    for policy in (RematPolicy.DOTS, RematPolicy.FULL):
        p, m = update(graphdef, params, data, policy, chunk=mib_for(3, data.targets.size, 384))
        for k in ("loss", "grad_norm", "entropy", "kl"):
            assert float(m[k]) == pytest.approx(float(base_m[k]), rel=1e-5, abs=1e-7), (policy, k)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, atol=1e-6), base_p, p)


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for x in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(x, "jaxpr", None)
                if sub is not None:
                    yield from _eqns(getattr(sub, "jaxpr", sub))


def _avals(jaxpr):
    """Every value of a jaxpr and of the jaxprs inside it (scan bodies, custom VJPs, remat)."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield v.aval
        for param in eqn.params.values():
            inner = param if isinstance(param, (list, tuple)) else [param]
            for x in inner:
                sub = getattr(x, "jaxpr", None)
                if sub is not None:
                    yield from _avals(getattr(sub, "jaxpr", sub))


def test_no_rows_by_tokens_by_vocab_tensor_in_the_update():
    vocab = 5003  # prime: no other dimension has this size
    graphdef, params, data = learner_inputs(vocab=vocab, n=40)
    tokens = data.targets.size
    hp = LossParams.from_config(
        GRPOConfig(beta=0.04, grad_accum_steps=1, prompts_per_step=4, num_generations=4),
        40,
        1.0,
        RematPolicy.NONE,
        mib_for(8, tokens, vocab),
    )
    learner = Learner(graphdef, OptimizerConfig(), hp, 10)
    jaxpr = jax.make_jaxpr(learner.update)(learner.init_state(params), data)
    width = -(-vocab // 8)  # 626 words per chunk
    big = [a.shape for a in _avals(jaxpr.jaxpr) if int(np.prod(getattr(a, "shape", ()))) >= tokens * width]
    assert any(width in s for s in big)  # the chunks exist: the check sees the head's values
    # and nothing near B x N x V: the largest values are the head's weight and gradient (V x E, E = 128)
    assert max(int(np.prod(s)) for s in big) < tokens * vocab / 4, big


def test_bf16_gradients_accumulate_in_f32():
    """Under accumulation the micro-batches' gradients of bf16 parameters are summed in f32 (the
    scan's carry) and rounded to bf16 once; the state keeps its dtypes (no recompile next step)."""
    model = create_model(get_preset("tiny", vocab_size=384, dtype="bfloat16", param_dtype="bfloat16"), 0)
    graphdef, params = nnx.split(model)
    _, _, data = learner_inputs()
    hp = LossParams.from_config(
        GRPOConfig(beta=0.04, grad_accum_steps=4, prompts_per_step=4, num_generations=4),
        data.targets.shape[1],
        0.9,
        RematPolicy.NONE,
        64,
    )
    learner = Learner(graphdef, OptimizerConfig(learning_rate=1e-3), hp, 10)
    state = learner.init_state(params)
    jaxpr = jax.make_jaxpr(learner.update)(state, data)
    scans = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "scan"]
    embed = params["model"]["embed_tokens"]["embedding"][...].shape
    carries = [v.aval for e in scans for v in e.outvars if getattr(v.aval, "shape", None) == embed]
    assert carries and all(a.dtype == jnp.float32 for a in carries), carries
    new, _ = learner.update(state, data)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new)):
        assert a.dtype == b.dtype
