"""Batched sampling: one jitted prefill and one jitted decode loop over a preallocated KV cache.

Graph and state are kept apart at the jit boundary: the jitted functions take the model's
parameters as an `nnx.State` and rebuild the module inside the trace, so a new set of weights
(each training step) reuses the compiled program. Prompts are left-padded to a bucket length
(`SamplingConfig.prompt_buckets`): one program per bucket, never one per batch.

Each of the `num_prompts` prompts is prefilled once and its cache repeated for its G samples,
so prompt compute does not grow with the group size. The decode loop is a `lax.while_loop`
that stops as soon as every row has hit EOS (tested once per chunk of `decode_chunk` tokens, 1 by
default). The KV cache is donated to it and updated in place, never copied: on a GPU and on
CPU each step's layers run as straight code over weights and a cache laid out one buffer per
layer, each layer writing its own; on a TPU a loop over the stacked layers only reads the cache
and the step writes every layer's new keys and values once after it
(CausalLM.decode_hidden_states). `python -m bench.decode_bytes` measures the bytes a token step
moves against the floor.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from grpo_core.config import switches
from grpo_core.config.train import SamplingConfig
from grpo_core.errors import ConfigError
from grpo_core.generate.types import Completions
from grpo_core.nn.model import CausalLM, causal_inputs, constrain_kv_cache, init_kv_cache


@dataclasses.dataclass(frozen=True)
class SamplerOptions:
    """The static part of sampling (a change recompiles)."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    eos_ids: tuple[int, ...]
    pad_id: int
    decode_chunk: int = 1  # tokens drawn between two all-rows-done tests (backend_defaults)
    one_pass: bool = False  # draw with Gumbel-max over the whole vocabulary (backend_defaults)
    unroll_layers: bool = False  # a decode step's layers as straight code, not a loop (backend_defaults)
    decode_phases: int = 1  # decode loops one after another, each reading the cache it can have filled

    @classmethod
    def from_config(cls, cfg: SamplingConfig, eos_ids: Sequence[int], pad_id: int, **overrides):
        """`overrides` may name any field; the chip-dependent ones default to the local backend's
        (backend_defaults), so a program compiled ahead for another chip passes that chip's."""
        opts = cls(
            cfg.max_new_tokens,
            cfg.temperature,
            cfg.top_k,
            cfg.top_p,
            () if cfg.ignore_eos else tuple(int(e) for e in eos_ids),
            int(pad_id),
        )
        return dataclasses.replace(opts, **{**backend_defaults(jax.default_backend()), **overrides})


def backend_defaults(platform: str) -> dict:
    """The options that depend on the chip the program runs on (a program compiled ahead for
    another chip passes that chip's): the decode chunk, and the draw. On a GPU or TPU a draw is one
    pass, Gumbel-max (`jax.random.categorical`) over the tempered log-probs; on CPU, where B x V
    random numbers per token cost 3x a cumulative sum at a real vocabulary, one uniform per row
    against the cumulative probabilities. On a GPU and on CPU, a decode step's layers run as
    straight code over weights and a cache laid out per layer (switches.decode_unrolled): on a GPU
    a loop over them launches each layer's kernels apart, and a loop's slice of a stacked array
    is copied before its matmuls on both (at Qwen2.5-0.5B's shape in float32 on CPU: 3.5x the
    bytes floor of a token step with the loop, 1.5x without; 764 against 640 ms a token step at
    384 tokens, for 4-8 s more compilation)."""
    return {
        # tokens per "every row done?" test (GRPO_DECODE_CHUNK; 1 on every platform): a chunk is a
        # fixed-count inner loop with no exit test inside, wasting at most chunk - 1 steps once
        # every row is done. On an H200 (gpu-0.5b) 1 and 16 decoded at the same speed, XLA:GPU
        # running the loop from command buffers; a TPU runs its loops on the chip.
        "decode_chunk": switches.decode_chunk(),
        "one_pass": platform != "cpu",
        "unroll_layers": switches.decode_unrolled(platform),
        # the decode loop in phases, each attending to the cache slots it can have filled (phase j
        # of k: the prompt and (j+1)/k of the completion), not all of them: a GPU's or TPU's token
        # step reads about N/2k slots more than it must instead of N/2 (bench.decode_bytes); each
        # phase compiles a loop body of its own, so CPU, where compilation dominates, keeps one
        # (GRPO_DECODE_PHASES=N overrides; at Qwen2.5-0.5B's shape XLA:TPU compiles 4 in 15-17 s, 1 in 11-12)
        "decode_phases": switches.decode_phases(1 if platform == "cpu" else 4),
    }


class DecodeState(NamedTuple):
    """The decode loop's state over B rows, beside the KV cache (prefill makes it, decode runs it)."""

    tokens: jax.Array  # (B, N) int32: the ids so far, pad beyond
    logprobs: jax.Array  # (B, N) float32: their log-probs, 0 beyond
    done: jax.Array  # (B,) bool: the row has emitted a stop token
    lengths: jax.Array  # (B,) int32: tokens so far, up to and including the stop token
    key_valid: jax.Array  # (B, Tp + N) bool: the cache slots attended to
    next_pos: jax.Array  # (B,) int32: the RoPE position of completion token 0
    t: jax.Array  # int32: the index of the next token to draw


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ConfigError(
        f"a prompt of {n} tokens is longer than the largest sampling.prompt_buckets entry "
        f"({buckets[-1]}); shorten prompts or add a bucket"
    )


def pad_prompts(prompts: Sequence[Sequence[int]], buckets: Sequence[int], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token lists to the smallest bucket holding the longest. -> (tokens, valid) (P, Tp)."""
    longest = max(len(p) for p in prompts)
    if longest == 0:
        raise ConfigError("an empty prompt (0 tokens) cannot be sampled from")
    tp = bucket_length(longest, buckets)
    tokens = np.full((len(prompts), tp), pad_id, np.int32)
    valid = np.zeros((len(prompts), tp), bool)
    for i, p in enumerate(prompts):
        if len(p):
            tokens[i, tp - len(p) :] = p
            valid[i, tp - len(p) :] = True
    return tokens, valid


def sample_logits(logits: jax.Array, key: jax.Array, opts: SamplerOptions) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row. logits: (B, V) f32. -> (ids (B,), logprob (B,)).

    The returned log-prob is under softmax(logits / T) before top-k/top-p filtering: the same
    distribution the learner scores, so the ratio pi_theta / pi_old starts at 1.
    """
    t = opts.temperature if opts.temperature > 0 else 1.0
    scaled = logits / t
    if opts.temperature == 0 or (opts.one_pass and opts.top_k == 0 and opts.top_p >= 1.0):
        # the whole vocabulary: the draw and the normaliser each one pass over the logits, and no
        # (B, V) log-probs written (the draw is the same: Gumbel-max ignores a shift per row)
        top = jnp.max(scaled, axis=-1, keepdims=True)
        log_norm = jnp.log(jnp.sum(jnp.exp(scaled - top), axis=-1))
        if opts.temperature == 0:
            ids = jnp.argmax(logits, axis=-1)
        else:
            ids = jax.random.categorical(key, scaled, axis=-1)
        chosen = jnp.take_along_axis(scaled - top, ids[:, None], axis=-1)[:, 0]
        return ids.astype(jnp.int32), chosen - log_norm
    if opts.top_k == 0 and opts.top_p >= 1.0:  # the whole vocabulary by the inverse CDF, in blocks
        return _inverse_cdf_blocked(scaled, key)
    logp_all = jax.nn.log_softmax(scaled, axis=-1)
    ids = _sample_filtered(logp_all, key, opts.top_k, opts.top_p, opts.one_pass)
    logp = jnp.take_along_axis(logp_all, ids[:, None], axis=-1)[:, 0]
    return ids.astype(jnp.int32), logp


def _inverse_cdf(probs: jax.Array, key: jax.Array) -> jax.Array:
    """One uniform per row against the cumulative probabilities: (B, V) -> (B,) indices.

    Cheaper than Gumbel-max (B uniforms instead of B*V) in a decode loop that draws every step.
    """
    cdf = jnp.cumsum(probs, axis=-1)
    u = jax.random.uniform(key, (probs.shape[0], 1), probs.dtype) * cdf[:, -1:]
    return jnp.minimum(jnp.sum(cdf <= u, axis=-1), probs.shape[-1] - 1)


CDF_BLOCK = 128  # words per block of _inverse_cdf_blocked


def _inverse_cdf_blocked(scaled: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """_inverse_cdf over softmax(scaled) without writing (B, V) probabilities or their running
    sum: the block sums of exp(scaled - max) (one pass over the logits, after the one for the
    max), their running sum picks each row's block, and the running sum within that block its
    word. -> (ids (B,), their log-probs under softmax(scaled))."""
    b, v = scaled.shape
    blk = min(CDF_BLOCK, v)
    nb = -(-v // blk)
    top = jnp.max(scaled, axis=-1, keepdims=True)
    blocks = jnp.pad(scaled, ((0, 0), (0, nb * blk - v)), constant_values=-jnp.inf).reshape(b, nb, blk)
    # (B, nb): the mass up to each block's end; exp inside the sum, so no (B, V) probabilities are written
    before = jnp.cumsum(jnp.sum(jnp.exp(blocks - top[:, :, None]), axis=-1), axis=-1)
    total = before[:, -1:]
    u = jax.random.uniform(key, (b, 1), scaled.dtype) * total
    j = jnp.minimum(jnp.sum(before <= u, axis=-1), nb - 1)  # the block where the running sum passes u
    start = jnp.where(j > 0, jnp.take_along_axis(before, jnp.maximum(j - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inner = jnp.exp(jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0] - top)  # (B, blk)
    k = jnp.minimum(jnp.sum(start[:, None] + jnp.cumsum(inner, axis=-1) <= u, axis=-1), blk - 1)
    ids = jnp.minimum(j * blk + k, v - 1)
    chosen = jnp.take_along_axis(scaled, ids[:, None], axis=-1)[:, 0]
    return ids.astype(jnp.int32), chosen - top[:, 0] - jnp.log(total[:, 0])


def _sample_filtered(logp: jax.Array, key: jax.Array, top_k: int, top_p: float, one_pass: bool = False) -> jax.Array:
    if top_k == 0:  # the whole vocabulary, the nucleus by a threshold: no sort
        if top_p < 1.0:
            logp = jnp.where(logp >= _nucleus_floor(logp, top_p), logp, -jnp.inf)
        return jax.random.categorical(key, logp, axis=-1) if one_pass else _inverse_cdf(jnp.exp(logp), key)
    # Top-k first (a partial sort of k), then the nucleus within those candidates.
    vals, idx = jax.lax.top_k(logp, top_k)  # (B, k), sorted descending
    probs = jnp.exp(vals)
    if top_p < 1.0:
        norm = probs / jnp.sum(probs, axis=-1, keepdims=True)
        before = jnp.cumsum(norm, axis=-1) - norm  # mass of strictly more likely candidates
        probs = jnp.where(before < top_p, probs, 0.0)  # the first candidate always stays
    choice = _inverse_cdf(probs, key)
    return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]


NUCLEUS_STEPS = 32  # bisection steps: the threshold to within 2^-32 of the largest log-prob's range


def _nucleus_floor(logp: jax.Array, top_p: float) -> jax.Array:
    """(B, V) normalised log-probs -> (B, 1): the least log-prob of the nucleus, the smallest set of
    most likely words whose mass reaches top_p (the words a sort-and-cumsum top-p keeps, ties
    aside), found by bisection on the threshold: each step one masked sum over the vocabulary
    instead of a sort of it. The most likely word always stays."""
    probs = jnp.exp(logp)
    top = jnp.max(logp, axis=-1, keepdims=True)
    mass = lambda floor: jnp.sum(jnp.where(logp >= floor, probs, 0.0), axis=-1, keepdims=True)

    def step(_, bounds):
        lo, hi = bounds  # mass(lo) >= top_p; hi: the best floor known to keep enough, or above
        mid = 0.5 * (lo + hi)
        ok = mass(mid) >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    least = jnp.min(jnp.where(jnp.isfinite(logp), logp, top), axis=-1, keepdims=True)
    lo, _ = jax.lax.fori_loop(0, NUCLEUS_STEPS, step, (least, top))
    return jnp.where(mass(top) >= top_p, top, lo)


def step_key(seed: int, step: int, round_: int = 0) -> jax.Array:
    """The PRNG key of training step `step`: a function of (seed, step), never reused."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), round_)


@functools.partial(jax.jit, static_argnames=("graphdef", "opts", "num_samples", "mesh"))
def prefill(graphdef, params, prompt_tokens, prompt_valid, key, *, opts: SamplerOptions, num_samples: int, mesh=None):
    """Run the prompts once, fill the cache, draw every row's first token.

    prompt_tokens/valid: (P, Tp). Returns the cache and a loop state for `decode` with
    B = P * num_samples rows.
    `mesh`: lay the KV cache out over it (runtime.mesh.KV_CACHE_AXES); decode keeps that layout.
    """
    model: CausalLM = nnx.merge(graphdef, params)
    p, tp = prompt_tokens.shape
    slots = tp + opts.max_new_tokens
    positions, mask = causal_inputs(prompt_valid)
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, slots - tp)))  # (P, Tp, S)
    cache = init_kv_cache(model.config, p, slots, mesh)
    h, cache = model.hidden_states(prompt_tokens, positions, mask, cache, 0)
    logits = model.logits(h[:, -1:])[:, 0]  # (P, V): left padding puts every prompt's end last

    # Repeat each prompt's cache for its G samples: rows i*G .. i*G+G-1 belong to prompt i.
    rep = lambda x: jnp.repeat(x, num_samples, axis=0)
    if opts.unroll_layers:  # decode's straight-code layers: a (B, K, S, D) buffer per layer (layers_apart)
        cache = tuple(tuple(jnp.repeat(c[i], num_samples, axis=0) for i in range(c.shape[0])) for c in cache)
    else:
        cache = jax.tree.map(lambda c: jnp.repeat(c, num_samples, axis=1), cache)  # (L, B, K, S, D)
    if mesh is not None:
        cache = constrain_kv_cache(cache, mesh)
    logits, prompt_valid = rep(logits), rep(prompt_valid)
    b = p * num_samples
    first, first_lp = sample_logits(logits, jax.random.fold_in(key, 0), opts)
    tokens = jnp.full((b, opts.max_new_tokens), opts.pad_id, jnp.int32).at[:, 0].set(first)
    logprobs = jnp.zeros((b, opts.max_new_tokens), jnp.float32).at[:, 0].set(first_lp)
    done = _is_eos(first, opts.eos_ids)
    lengths = jnp.ones((b,), jnp.int32)
    key_valid = jnp.concatenate([prompt_valid, jnp.zeros((b, opts.max_new_tokens), bool)], axis=1)
    next_pos = jnp.sum(prompt_valid, axis=1).astype(jnp.int32)  # (B,) RoPE position of token 0
    state = DecodeState(
        tokens=tokens,
        logprobs=logprobs,
        done=done,
        lengths=lengths,
        key_valid=key_valid,
        next_pos=next_pos,
        t=jnp.int32(1),
    )
    return cache, state


def _is_eos(ids, eos_ids):
    if not eos_ids:
        return jnp.zeros(ids.shape, bool)
    return jnp.isin(ids, jnp.asarray(eos_ids, jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "opts", "prompt_len"), donate_argnums=(2,))
def decode(graphdef, params, cache, state: DecodeState, key, *, opts: SamplerOptions, prompt_len: int):
    """Generate tokens 1..N-1 in one compiled loop. The cache (argument 2) is donated.
    -> (the cache, the rows' Completions)."""
    model: CausalLM = nnx.merge(graphdef, params)
    n, chunk = opts.max_new_tokens, max(1, opts.decode_chunk)
    layers = model.layers_apart() if opts.unroll_layers else None  # outside the loop: once a call

    def step(carry, guard: bool, span: int | None):
        """Draw token t. `guard`: t may be past the last token (a chunk's tail), when nothing is
        written (the step's compute is wasted, its outputs dropped)."""
        cache, s = carry
        t = s.t
        slot = prompt_len + t - 1  # the cache slot of the previous token, fed now
        prev = jax.lax.dynamic_slice_in_dim(s.tokens, t - 1, 1, axis=1)  # (B, 1)
        pos = (s.next_pos + t - 1)[:, None]  # (B, 1)
        # the token attends to the slots filled before it and to itself; its slot is filled after
        h, cache = model.decode_hidden_states(prev, pos, s.key_valid, cache, slot, layers=layers, span=span)
        key_valid = jax.lax.dynamic_update_slice_in_dim(s.key_valid, jnp.ones((prev.shape[0], 1), bool), slot, 1)
        ids, lp = sample_logits(model.logits(h)[:, 0], jax.random.fold_in(key, t), opts)
        live = ~s.done & (t < n) if guard else ~s.done
        ids = jnp.where(live, ids, opts.pad_id)
        lp = jnp.where(live, lp, 0.0)
        at = jnp.minimum(t, n - 1) if guard else t
        if guard:  # past the end: write back what is there
            ids = jnp.where(t < n, ids, jax.lax.dynamic_index_in_dim(s.tokens, at, 1, keepdims=False))
            lp = jnp.where(t < n, lp, jax.lax.dynamic_index_in_dim(s.logprobs, at, 1, keepdims=False))
        s = s._replace(
            t=t + 1,
            key_valid=key_valid,
            tokens=jax.lax.dynamic_update_slice_in_dim(s.tokens, ids[:, None], at, 1),
            logprobs=jax.lax.dynamic_update_slice_in_dim(s.logprobs, lp[:, None], at, 1),
            lengths=s.lengths + live.astype(jnp.int32),
            done=s.done | (_is_eos(ids, opts.eos_ids) & live),
        )
        return cache, s

    def until(end):
        return lambda carry: (carry[1].t < end) & ~jnp.all(carry[1].done)

    carry = (cache, state)
    if chunk == 1:  # phase j draws tokens up to ends[j]: the slots below prompt_len + ends[j] - 1 are all it reads
        for end in _phase_ends(opts):
            span = None if end == n else prompt_len + end - 1
            carry = jax.lax.while_loop(until(end), functools.partial(step, guard=False, span=span), carry)
    else:  # a fixed-count inner loop: no host test between its steps (backend_defaults)
        body = lambda carry: jax.lax.fori_loop(0, chunk, lambda _, c: step(c, guard=True, span=None), carry)
        carry = jax.lax.while_loop(until(n), body, carry)
    # The cache is returned (and dropped by the caller) so the donated input buffer can alias
    # an output: XLA then updates it in place instead of copying it into the loop.
    cache, s = carry
    return cache, Completions(tokens=s.tokens, logprobs=s.logprobs, lengths=s.lengths, truncated=~s.done)


def _phase_ends(opts: SamplerOptions) -> list[int]:
    """The token index each phase of the decode loop stops before (see backend_defaults)."""
    n = opts.max_new_tokens
    if max(1, opts.decode_chunk) != 1 or n < 2:
        return [n]
    phases = max(1, min(opts.decode_phases, n - 1))
    return sorted({1 + -(-(n - 1) * (j + 1) // phases) for j in range(phases)})


def phase_steps(opts: SamplerOptions) -> list[int]:
    """Iterations of each of the decode program's loops for completions of full length (prefill
    draws token 0, the loops the N - 1 others): token steps, or with `decode_chunk` > 1 one loop
    of ceil((N - 1) / chunk) chunks. What the loops' costs are weighted by
    (grpo_core.rl.hlo_cost.Analysis.weighted, grpo_core.config.roofline)."""
    chunk = max(1, opts.decode_chunk)
    if chunk > 1:
        return [-(-(opts.max_new_tokens - 1) // chunk)]
    ends = _phase_ends(opts)
    return [e - s for s, e in zip([1, *ends[:-1]], ends)]


def _on_device(x):
    """Host arrays copied to the default device (jnp.asarray compiles a program per shape for
    that); arrays already laid out, on a mesh of several hosts too, as they are."""
    return x if isinstance(x, jax.Array) else jax.device_put(x)


def generate(
    model_or_graphdef, params, prompt_tokens, prompt_valid, key, opts: SamplerOptions, num_samples: int = 1, mesh=None
) -> Completions:
    """Sample `num_samples` completions for each left-padded prompt: B = P * num_samples rows,
    rows i*G .. i*G+G-1 following prompt i, as device arrays. No host sync inside.
    `mesh`: the rollout's (grpo_core.runtime.mesh), over which the KV cache is laid out."""
    graphdef = model_or_graphdef
    if isinstance(model_or_graphdef, nnx.Module):
        graphdef, params = nnx.split(model_or_graphdef)
    cache, state = prefill(
        graphdef,
        params,
        _on_device(prompt_tokens),
        _on_device(prompt_valid),
        key,
        opts=opts,
        num_samples=num_samples,
        mesh=mesh,
    )
    _, out = decode(graphdef, params, cache, state, key, opts=opts, prompt_len=int(prompt_tokens.shape[1]))
    return out


def stop_ids(tokenizer) -> list[int]:
    """The ids that end a completion: the tokenizer's `stop_ids` (an HF model's generation config
    may list several, e.g. <|im_end|> and <|endoftext|>), else its EOS."""
    ids = getattr(tokenizer, "stop_ids", None)
    return [int(i) for i in ids] if ids else [int(tokenizer.eos_token_id)]


def completion_texts(tokenizer, tokens: np.ndarray, lengths: np.ndarray, eos_ids, rows: int | None = None) -> list[str]:
    """Decode host completions up to their length, without the closing EOS."""
    out = []
    for i in range(len(tokens) if rows is None else rows):
        ids = list(tokens[i, : lengths[i]])
        if ids and ids[-1] in eos_ids:
            ids = ids[:-1]
        out.append(tokenizer.decode(ids))
    return out


def completion_ids(tokens: np.ndarray, lengths: np.ndarray, rows: int | None = None) -> list[list[int]]:
    """Host completions' token ids up to their length (the closing EOS included, as TRL passes
    completion_ids to reward functions)."""
    return [[int(t) for t in tokens[i, : lengths[i]]] for i in range(len(tokens) if rows is None else rows)]


def spec_of(tree):
    """Shapes, dtypes and mesh layouts of a pytree of arrays, for ahead-of-time compilation: a
    program compiled for these is the one a call with the arrays themselves finds in the cache."""

    def one(x):
        sharding = getattr(x, "sharding", None)
        # a mesh layout, or a device an array is committed to (a jit call compiles for that device
        # apart from an uncommitted array's default one); a spec's own sharding as it is
        kept = isinstance(sharding, NamedSharding) or getattr(x, "committed", isinstance(x, jax.ShapeDtypeStruct))
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding if kept else None)

    return jax.tree.map(one, tree)


def compile_jobs(graphdef, params, prompt_tokens, prompt_valid, key, opts: SamplerOptions, num_samples: int, mesh=None):
    """Callables that compile prefill and decode for this prompt shape (run them in threads),
    the last returning the compiled decode:
    XLA compiles with the GIL released, so on a cold start they overlap each other and the
    learner's compilation instead of running one after another."""
    p_spec, t_spec, v_spec, k_spec = spec_of((params, prompt_tokens, prompt_valid, key))
    kw = dict(opts=opts, num_samples=num_samples, mesh=mesh)
    cache, state = jax.eval_shape(
        lambda p, t, v, k: prefill(graphdef, p, t, v, k, **kw), p_spec, t_spec, v_spec, k_spec
    )
    compile_decode = lambda cache, state: decode.lower(
        graphdef, p_spec, cache, state, k_spec, opts=opts, prompt_len=int(prompt_tokens.shape[1])
    ).compile()
    if mesh is None and all(x.sharding is None for x in jax.tree.leaves(p_spec)):
        return [
            lambda: prefill.lower(graphdef, p_spec, t_spec, v_spec, k_spec, **kw).compile(),
            lambda: compile_decode(cache, state),
        ]

    # on a mesh, or with the weights committed to a device, decode takes prefill's outputs in the
    # layouts (on the device) prefill's program gives them
    def both():
        out = prefill.lower(graphdef, p_spec, t_spec, v_spec, k_spec, **kw).compile().output_shardings
        laid = lambda spec, sh: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), spec, sh)
        return compile_decode(laid(cache, out[0]), laid(state, out[1]))

    return [both]
