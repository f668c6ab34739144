"""Evaluation of a policy on held-out rows: greedy reward means, and pass@k from sampled rows."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from grpo_core.agent import episodes
from grpo_core.config.train import SamplingConfig
from grpo_core.generate.sampler import (
    SamplerOptions,
    completion_ids,
    completion_texts,
    generate,
    pad_prompts,
    spec_of,
    step_key,
    stop_ids,
)
from grpo_core.generate.sampler import compile_jobs as sampler_compile_jobs
from grpo_core.generate.types import Completions
from grpo_core.rewards import functions as rw
from grpo_core.runtime.mesh import to_host


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def _options(tokenizer, sampling: SamplingConfig, eos_ids, num_samples: int) -> SamplerOptions:
    """The sampler's options of an evaluation: greedy with one sample, else sampling.temperature."""
    return SamplerOptions.from_config(
        sampling,
        eos_ids if eos_ids is not None else stop_ids(tokenizer),
        tokenizer.pad_token_id,
        temperature=0.0 if num_samples == 1 else sampling.temperature,
    )


def _batches(tokenizer, rows: Sequence[dict[str, Any]], sampling: SamplingConfig, batch_size: int, pad_id: int):
    """(first row's index, the batch's rows, how many are real, prompt tokens, valid) of each
    batch: all of one shape (the last one padded with copies of its first row) where the rows
    take more than one batch."""
    for start in range(0, len(rows), batch_size):
        chunk = list(rows[start : start + batch_size])
        real = len(chunk)
        chunk += [chunk[0]] * (batch_size - real) if len(rows) > batch_size else []  # one shape: one compile
        ids = [r["prompt_ids"] if "prompt_ids" in r else tokenizer.encode(r["prompt"]) for r in chunk]
        yield (start, chunk, real, *pad_prompts(ids, sampling.prompt_buckets, pad_id))


def _rollout_mesh(placement):
    return None if placement is None else placement.spread_rollout()


def complete(
    graphdef,
    params,
    tokenizer,
    rows: Sequence[dict[str, Any]],
    sampling: SamplingConfig,
    *,
    batch_size: int = 64,
    eos_ids: Sequence[int] | None = None,
    num_samples: int = 1,
    seed: int = 0,
    placement=None,
    turns: episodes.Turns | None = None,
):
    """Completion texts for `rows`, in batches of one shape (the last one padded): yields
    (the batch's rows, its num_samples completions per row, (tokens, lengths, completions) of
    the host arrays, the batch's episodes or None). num_samples == 1 is greedy. With a `placement`
    (grpo_core.runtime.mesh) whose rollout mesh has several devices, the weights, prompts and KV
    cache are laid out over it as the rollout's are, and the completions come back whole to every
    process. `turns`: each row an episode (train.agent), as in training; its texts are the final
    answers, and the caller closes the episodes."""
    mesh = _rollout_mesh(placement)
    if mesh is not None:
        params = placement.put_params(params, mesh)
    opts = _options(tokenizer, sampling, eos_ids, num_samples)
    if turns is not None:  # a call ends a model's turn too (the plain format's mark)
        opts = dataclasses.replace(opts, eos_ids=turns.eos_ids)

    def draw(ptok, pval, key, samples: int) -> Completions:
        if mesh is not None:
            ptok, pval = placement.put_batch((ptok, pval), mesh)
        c = generate(graphdef, params, ptok, pval, key, opts, samples, mesh)
        return Completions(*to_host((c.tokens, c.logprobs, c.lengths, c.truncated)))

    for start, chunk, real, ptok, pval in _batches(tokenizer, rows, sampling, batch_size, opts.pad_id):
        n = real * num_samples
        if turns is None:
            if mesh is not None:
                ptok, pval = placement.put_batch((ptok, pval), mesh)
            c = generate(graphdef, params, ptok, pval, step_key(seed, start), opts, num_samples, mesh)
            tokens, lengths = to_host((c.tokens, c.lengths))
            yield (
                chunk[:real],
                completion_texts(tokenizer, tokens, lengths, opts.eos_ids, rows=n),
                (tokens, lengths, n),
                None,
            )
            continue
        prompt_with = lambda row, obs: episodes.prompt_with(tokenizer, row, obs)  # noqa: E731
        eps, _, _ = episodes.run(draw, turns, chunk, ptok, pval, step_key(seed, start), num_samples, prompt_with)
        c = eps.completions
        yield chunk[:real], eps.finals[:n], (c.tokens, c.lengths, n), eps


def compile_jobs(
    graphdef,
    params,
    tokenizer,
    rows: Sequence[dict[str, Any]],
    sampling: SamplingConfig,
    *,
    batch_size: int = 64,
    eos_ids: Sequence[int] | None = None,
    num_samples: int = 1,
    placement=None,
) -> list:
    """Callables that compile the sampler's programs `complete` runs with the same arguments, one
    per prompt shape of its batches, for a thread to run before the evaluation (the worker's,
    while it trains). `params`: arrays or jax.ShapeDtypeStructs of the evaluated policy's shapes
    and dtypes, where the evaluation's own arrays lie (one device: committed to it)."""
    mesh = _rollout_mesh(placement)
    if mesh is not None:
        params = placement.put_params(params, mesh)  # shapes stay shapes, laid out
    opts = _options(tokenizer, sampling, eos_ids, num_samples)
    jobs, shapes = [], set()
    for start, _, _, ptok, pval in _batches(tokenizer, rows, sampling, batch_size, opts.pad_id):
        if ptok.shape in shapes:
            continue
        shapes.add(ptok.shape)
        if mesh is not None:
            ptok, pval = placement.put_batch(spec_of((ptok, pval)), mesh)
        jobs += sampler_compile_jobs(graphdef, params, ptok, pval, step_key(0, start), opts, num_samples, mesh)
    return jobs


def evaluate(
    graphdef,
    params,
    tokenizer,
    rows: Sequence[dict[str, Any]],
    rewards: Sequence[rw.Reward],
    sampling: SamplingConfig,
    *,
    batch_size: int = 64,
    eos_ids: Sequence[int] | None = None,
    num_samples: int = 1,
    seed: int = 0,
    pass_reward: str | None = None,
    reward_timeout_s: float | None = None,
    state: rw.TrainerState | None = None,
    placement=None,
    on_rows: Callable[[int], None] | None = None,
    turns: episodes.Turns | None = None,
) -> dict[str, float]:
    """Mean of each reward over `rows`. num_samples == 1 decodes greedily; more samples draw at
    `sampling.temperature` and add pass@k: a sample "passes" when the `pass_reward` function
    scores it >= 1 (default: the weighted total). `reward_timeout_s` bounds each reward
    function's call on one batch (train.reward_timeout_s; RewardTimeout past it); `state` is the
    trainer_state reward functions see (the evaluated checkpoint's step); `placement`: see
    complete; `on_rows(rows scored so far)` is called after each batch (the worker's progress);
    `turns`: the rows are episodes (train.agent), whose turns, tool calls and tool errors per
    episode join the result."""
    per: dict[str, list[np.ndarray]] = {r.name: [] for r in rewards}
    totals = []
    done = 0
    stats: dict[str, list[float]] = {"turns": [], "calls": [], "errors": []}
    for chunk, texts, (tokens, lengths, n), eps in complete(
        graphdef,
        params,
        tokenizer,
        rows,
        sampling,
        batch_size=batch_size,
        eos_ids=eos_ids,
        num_samples=num_samples,
        seed=seed,
        placement=placement,
        turns=turns,
    ):
        prompts, completions, columns = rw.reward_inputs(
            chunk, texts, repeat=num_samples, completion_ids=completion_ids(tokens, lengths, rows=n), state=state
        )
        where = f"the evaluation batch of rows {done}..{done + len(chunk) - 1}" + (
            f" ({num_samples} samples each)" if num_samples > 1 else " (greedy)"
        )
        done += len(chunk)
        whole = None
        if eps is not None:  # the batch's real rows: a padded batch's copies are not scored
            columns.update({k: v[:n] for k, v in episodes.reward_columns(eps).items()})
            whole = eps.messages[:n] if completions and isinstance(completions[0], list) else texts
            stats["turns"] += [float(t) for t in eps.turns[:n]]
            stats["calls"] += [float(len(c)) for c in eps.calls[:n]]
            stats["errors"] += [float(sum(x.error for x in c)) for c in eps.calls[:n]]
        try:
            scored = rw.score(
                rewards, prompts, completions, columns, timeout_s=reward_timeout_s, batch=where, episodes=whole
            )
        finally:
            if eps is not None:
                eps.close()
        totals.append(scored.total)
        for name, v in scored.per_function.items():
            per[name].append(v)
        if on_rows is not None:
            on_rows(done)
    out = {"num_rows": float(len(rows)), "reward_mean": float(np.nanmean(np.concatenate(totals)))}
    for name, vs in per.items():
        out[name] = float(np.nanmean(np.concatenate(vs)))
    if stats["turns"]:
        for key, name in (("turns", "turns"), ("calls", "tool_calls"), ("errors", "tool_errors")):
            out[f"{name}_per_episode"] = float(np.mean(stats[key]))
    if num_samples > 1:
        scores = per[pass_reward] if pass_reward is not None else totals
        total = np.concatenate(scores).reshape(-1, num_samples)
        for k in sorted({1, num_samples}):
            out[f"pass@{k}"] = float(np.mean([pass_at_k(num_samples, int(np.sum(t >= 1.0)), k) for t in total]))
    return out
