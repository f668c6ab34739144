import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_core.config.model import ModelConfig
from grpo_core.errors import ConfigError
from grpo_core.nn.model import create_model
from grpo_core.rl.learner import completion_logprobs
from grpo_core.rl.sampler import SamplerOptions, bucket_length, generate, pad_prompts, sample_logits, step_key

CFG = ModelConfig(
    vocab_size=40,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=48,
    qk_norm=True,
)
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11], [12]]


def opts(**kw):
    base = dict(max_new_tokens=7, temperature=1.0, top_k=0, top_p=1.0, eos_ids=(), pad_id=0)
    return SamplerOptions(**{**base, **kw})


@pytest.fixture(scope="module")
def model():
    return create_model(CFG, seed=3)


def test_greedy_equals_argmax_of_full_forward(model):
    tok, val = pad_prompts(PROMPTS, (4, 8), 0)
    out = generate(model, None, tok, val, jax.random.key(0), opts(temperature=0.0))
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))  # causal: right padding is harmless
    for i, p in enumerate(PROMPTS):
        seq = np.zeros((1, 16), np.int32)
        seq[0, : len(p)] = p
        for j in range(len(p), len(p) + 7):
            seq[0, j] = int(jnp.argmax(forward(params, seq)[0, j - 1]))
        assert list(np.asarray(out.tokens[i])) == seq[0, len(p) : len(p) + 7].tolist()


def test_kv_cache_logprobs_match_full_forward(model):
    """Sampled tokens' log-probs from the cached decode equal a full forward's, per token."""
    tok, val = pad_prompts(PROMPTS, (8,), 0)
    out = generate(model, None, tok, val, jax.random.key(1), opts(temperature=0.7), num_samples=2)
    assert out.tokens.shape == (6, 7)  # rows 2i and 2i + 1 follow prompt i
    full, _ = completion_logprobs(model, tok, val, out.tokens, 0.7)
    np.testing.assert_allclose(out.logprobs, full, atol=2e-5, rtol=1e-4)


def test_eos_stops_rows_and_reports_lengths(model):
    tok, val = pad_prompts(PROMPTS, (8,), 0)
    greedy = generate(model, None, tok, val, jax.random.key(0), opts(temperature=0.0))
    eos = int(greedy.tokens[0, 2])  # the token row 0 emits third becomes EOS
    out = generate(model, None, tok, val, jax.random.key(0), opts(temperature=0.0, eos_ids=(eos,), pad_id=39))
    row = np.asarray(out.tokens[0])
    first = list(np.asarray(greedy.tokens[0])).index(eos)
    assert int(out.lengths[0]) == first + 1 and not bool(out.truncated[0])
    assert (row[first + 1 :] == 39).all()
    for i in range(3):
        toks = list(np.asarray(greedy.tokens[i]))
        if eos not in toks:
            assert bool(out.truncated[i]) and int(out.lengths[i]) == 7


def test_top_k_and_top_p_stay_in_their_set():
    logits = jax.random.normal(jax.random.key(0), (4, 50)) * 3
    probs = np.asarray(jax.nn.softmax(logits, -1))
    for k, p in ((5, 1.0), (0, 0.6), (8, 0.5)):
        allowed = []
        for row in probs:
            order = np.argsort(-row)
            keep = order[:k] if k else order
            mass_before = np.cumsum(row[keep]) / row[keep].sum() - row[keep] / row[keep].sum()
            allowed.append(set(keep[mass_before < p].tolist()))
        o = opts(top_k=k, top_p=p)
        draw = jax.jit(jax.vmap(lambda key: sample_logits(logits, key, o)[0]))
        ids = np.asarray(draw(jax.random.split(jax.random.key(k), 500)))  # (500, 4)
        seen = [set(ids[:, r].tolist()) for r in range(4)]
        for r in range(4):
            assert seen[r] <= allowed[r], (k, p, r)
        assert max(len(x) for x in seen) > 1  # it does sample, not argmax


def test_step_keys_differ_and_repeat():
    assert not np.array_equal(jax.random.key_data(step_key(0, 1)), jax.random.key_data(step_key(0, 2)))
    assert np.array_equal(jax.random.key_data(step_key(5, 3)), jax.random.key_data(step_key(5, 3)))


def test_buckets_pad_left_to_the_smallest_fit():
    tok, val = pad_prompts([[1, 2, 3], [4, 5, 6, 7, 8]], (4, 8, 16), 0)
    assert tok.shape == (2, 8)
    assert tok[0].tolist() == [0, 0, 0, 0, 0, 1, 2, 3] and val[0].sum() == 3
    assert bucket_length(9, (4, 8, 16)) == 16
    with pytest.raises(ConfigError, match="longer than the largest sampling.prompt_buckets entry"):
        bucket_length(17, (4, 8, 16))


def test_one_compile_per_bucket(model):
    from grpo_core.rl import sampler

    graphdef, params = nnx.split(model)
    key = jax.random.key(0)
    before = sampler.decode._cache_size()
    for prompts in ([[1, 2, 3]], [[4, 5]], [[6, 7, 8, 9]]):  # all in bucket 4
        tok, val = pad_prompts(prompts, (4, 8), 0)
        generate(graphdef, params, tok, val, key, opts())
    assert sampler.decode._cache_size() - before <= 1


def test_sampling_frequencies_follow_the_distribution():
    logits = jnp.log(jnp.array([[0.5, 0.25, 0.125, 0.125, 1e-9]]))
    draw = jax.jit(jax.vmap(lambda key: sample_logits(logits, key, opts())[0][0]))
    ids = np.asarray(draw(jax.random.split(jax.random.key(0), 20000)))
    freq = np.bincount(ids, minlength=5) / len(ids)
    np.testing.assert_allclose(freq, [0.5, 0.25, 0.125, 0.125, 0.0], atol=0.015)
    # temperature 2 flattens: probabilities proportional to sqrt(p)
    hot = jax.jit(jax.vmap(lambda key: sample_logits(logits[:, :4], key, opts(temperature=2.0))[0][0]))
    freq = np.bincount(np.asarray(hot(jax.random.split(jax.random.key(1), 20000))), minlength=4) / 20000
    want = np.sqrt([0.5, 0.25, 0.125, 0.125]) / np.sqrt([0.5, 0.25, 0.125, 0.125]).sum()
    np.testing.assert_allclose(freq, want, atol=0.015)


@pytest.mark.parametrize("chunk", [3, 16])
@pytest.mark.parametrize("stop", [False, True])
def test_decode_chunks_draw_what_one_token_at_a_time_draws(model, chunk, stop):
    """A chunked loop (one all-done test per `chunk` tokens, steps past the end wasted) gives the
    very tokens, log-probs, lengths and truncation flags of the one-token loop, with EOS or not,
    whether or not the chunk divides the completion length."""
    tok, val = pad_prompts(PROMPTS, (8,), 0)
    base = opts(temperature=0.0)
    eos = (int(generate(model, None, tok, val, jax.random.key(0), base).tokens[0, 2]),) if stop else ()
    one = opts(temperature=0.9, eos_ids=eos, pad_id=39)
    want = generate(model, None, tok, val, jax.random.key(4), one, num_samples=2)
    got = generate(
        model, None, tok, val, jax.random.key(4), opts(**{**vars(one), "decode_chunk": chunk}), num_samples=2
    )
    for field in ("tokens", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6)
    if stop:
        assert not bool(np.all(want.truncated))


@pytest.mark.parametrize(
    "variant",
    [
        dict(decode_phases=3),  # phases of 2, 2 and 2 token steps, each reading its part of the cache
        dict(decode_phases=9),  # more phases than steps: one step each
        dict(unroll_layers=True),  # straight-code layers over weights laid out per layer
        dict(unroll_layers=True, decode_phases=2, one_pass=True),
    ],
)
@pytest.mark.parametrize("stop", [False, True])
def test_decode_layouts_draw_what_the_plain_loop_draws(model, variant, stop):
    """The decode loop in phases, and its layers as straight code, give the plain loop's tokens,
    log-probs, lengths and truncation flags (EOS or not), and the phases split N - 1 steps."""
    from grpo_core.generate.sampler import phase_steps

    tok, val = pad_prompts(PROMPTS, (8,), 0)
    eos = (int(generate(model, None, tok, val, jax.random.key(0), opts(temperature=0.0)).tokens[0, 2]),) if stop else ()
    plain = opts(temperature=0.9, eos_ids=eos, pad_id=39, one_pass=variant.get("one_pass", False))
    want = generate(model, None, tok, val, jax.random.key(4), plain, num_samples=2)
    other = opts(**{**vars(plain), **variant})
    got = generate(model, None, tok, val, jax.random.key(4), other, num_samples=2)
    for field in ("tokens", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    steps = phase_steps(other)
    assert sum(steps) == other.max_new_tokens - 1 and len(steps) == min(other.decode_phases, 6) and min(steps) >= 1


@pytest.mark.parametrize("unroll", [False, True])
def test_decode_updates_the_cache_in_place(model, unroll):
    """The compiled decode loop aliases the donated KV cache to its output and keeps no second
    copy of it (its scratch space holds one layer's keys and values being read, less than the
    cache; with straight-code layers, the cache is a buffer per layer and the scratch space the
    weights laid out per layer besides): XLA's buffer assignment says so."""
    from grpo_core.rl import sampler

    tok, val = pad_prompts(PROMPTS, (8,), 0)
    graphdef, params = nnx.split(model)
    o = opts(max_new_tokens=64, decode_chunk=4, unroll_layers=unroll)
    cache, state = sampler.prefill(graphdef, params, tok, val, jax.random.key(0), opts=o, num_samples=8)
    leaves = jax.tree.leaves(cache)
    assert len(leaves) == (2 * CFG.num_hidden_layers if unroll else 2)
    cache_bytes = sum(c.nbytes for c in leaves)
    compiled = sampler.decode.lower(graphdef, params, cache, state, jax.random.key(0), opts=o, prompt_len=8).compile()
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes >= cache_bytes
    layers = sum(x.nbytes for x in jax.tree.leaves(params["model"]["layers"])) if unroll else 0
    assert mem.temp_size_in_bytes < cache_bytes + layers, (mem.temp_size_in_bytes, cache_bytes, layers)


def test_backend_defaults_and_chunk_setting(monkeypatch):
    from grpo_core.rl.sampler import backend_defaults

    monkeypatch.delenv("GRPO_DECODE_CHUNK", raising=False)
    monkeypatch.delenv("GRPO_DECODE_UNROLL", raising=False)
    monkeypatch.delenv("GRPO_DECODE_PHASES", raising=False)
    assert backend_defaults("cpu") == {"decode_chunk": 1, "one_pass": False, "unroll_layers": True, "decode_phases": 1}
    assert backend_defaults("tpu") == {"decode_chunk": 1, "one_pass": True, "unroll_layers": False, "decode_phases": 4}
    assert backend_defaults("gpu")["unroll_layers"]
    monkeypatch.setenv("GRPO_DECODE_UNROLL", "0")
    assert not backend_defaults("cpu")["unroll_layers"] and not backend_defaults("gpu")["unroll_layers"]
    monkeypatch.delenv("GRPO_DECODE_UNROLL")
    monkeypatch.setenv("GRPO_DECODE_PHASES", "2")
    assert backend_defaults("tpu")["decode_phases"] == 2
    monkeypatch.setenv("GRPO_DECODE_PHASES", "none")
    with pytest.raises(ConfigError, match="GRPO_DECODE_PHASES='none'"):
        backend_defaults("tpu")
    monkeypatch.delenv("GRPO_DECODE_PHASES")
    monkeypatch.setenv("GRPO_DECODE_CHUNK", "4")
    assert backend_defaults("gpu")["decode_chunk"] == 4
    monkeypatch.setenv("GRPO_DECODE_CHUNK", "0")
    with pytest.raises(ConfigError, match="GRPO_DECODE_CHUNK='0'"):
        backend_defaults("gpu")


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_nucleus_threshold_keeps_the_sorted_nucleus(top_p):
    """The bisection's floor keeps exactly the words a sort-and-cumsum nucleus keeps, at a real
    vocabulary's width, peaked rows and flat ones."""
    from grpo_core.generate.sampler import _nucleus_floor

    logits = jax.random.normal(jax.random.key(7), (6, 4096)) * jnp.array([0.1, 1, 3, 6, 10, 20])[:, None]
    logp = jax.nn.log_softmax(logits, -1)
    keep = np.asarray(logp >= _nucleus_floor(logp, top_p))
    probs = np.exp(np.asarray(logp, np.float64))
    for r in range(len(probs)):
        order = np.argsort(-probs[r])
        before = np.cumsum(probs[r][order]) - probs[r][order]
        want = np.zeros(probs.shape[1], bool)
        want[order[before < top_p]] = True
        assert abs(int(keep[r].sum()) - int(want.sum())) <= 1, (r, keep[r].sum(), want.sum())  # f32 vs f64 sums
        assert (keep[r] & want).sum() >= want.sum() - 1


def test_blocked_draw_picks_what_the_running_sum_picks():
    """The whole vocabulary's draw on CPU, in blocks (no (B, V) probabilities or running sum
    written), picks the word one running sum over every word picks for the same uniform, across
    block edges and a last block that is not full, with its log-prob under the softmax."""
    from grpo_core.generate.sampler import CDF_BLOCK, _inverse_cdf, _inverse_cdf_blocked

    v = 2 * CDF_BLOCK + 44
    scaled = jax.random.normal(jax.random.key(5), (64, v)) * 3
    logp = jax.nn.log_softmax(scaled, axis=-1)
    keys = jax.random.split(jax.random.key(6), 40)
    ids, lp = jax.jit(jax.vmap(lambda k: _inverse_cdf_blocked(scaled, k)))(keys)
    want = jax.jit(jax.vmap(lambda k: _inverse_cdf(jnp.exp(logp), k)))(keys)
    ids, want = np.asarray(ids), np.asarray(want)
    assert (ids == want).mean() > 0.999, (ids != want).sum()  # f32 sums in another order: a rare tie
    assert set(np.unique(ids // CDF_BLOCK)) == {0, 1, 2}
    np.testing.assert_allclose(
        lp, np.take_along_axis(np.asarray(logp)[None].repeat(40, 0), ids[..., None], -1)[..., 0], atol=1e-5
    )


@pytest.mark.parametrize("one_pass", [False, True])
def test_whole_vocabulary_draws_follow_the_distribution(one_pass):
    """Both draws (one uniform per row against the CDF; Gumbel-max), plain and under top-p."""
    logits = jnp.log(jnp.array([[0.5, 0.25, 0.125, 0.125, 1e-9]]))
    draw = lambda o: jax.jit(jax.vmap(lambda key: sample_logits(logits, key, o)[0][0]))
    ids = np.asarray(draw(opts(one_pass=one_pass))(jax.random.split(jax.random.key(0), 20000)))
    np.testing.assert_allclose(np.bincount(ids, minlength=5) / len(ids), [0.5, 0.25, 0.125, 0.125, 0.0], atol=0.015)
    ids = np.asarray(draw(opts(one_pass=one_pass, top_p=0.7))(jax.random.split(jax.random.key(1), 20000)))
    np.testing.assert_allclose(np.bincount(ids, minlength=5) / len(ids), [2 / 3, 1 / 3, 0, 0, 0], atol=0.015)
