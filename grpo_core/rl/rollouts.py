"""One step's batch: prompts -> the rollout engine's completions (episodes with train.agent) ->
rewards, with dynamic sampling's extra rounds. What a synchronous step runs in the learner's
process, and what the rollout side runs ahead of the learner with train.max_staleness >= 1 (a
thread, or the split layout's process: grpo_core.rl.overlap).

Determinism for resume: step s draws its prompts from `PromptSource.sample(s, round, n)` and its
PRNG key from (seed, s, round), so the batch of step s is a pure function of the policy that draws it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np

from grpo_core.agent import episodes
from grpo_core.agent.tools import load_toolbox
from grpo_core.config.train import TrainConfig
from grpo_core.generate.sampler import (
    SamplerOptions,
    completion_ids,
    completion_texts,
    pad_prompts,
    step_key,
    stop_ids,
)
from grpo_core.generate.types import Completions
from grpo_core.rewards import functions as rw
from grpo_core.rl import algo


class Tokenizer(Protocol):
    eos_token_id: int
    pad_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class PromptSource(Protocol):
    def sample(self, step: int, round_: int, n: int) -> list[dict[str, Any]]:
        """n rows, each {"prompt": str, **columns}; a pure function of (step, round_)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rollout:
    """One step's completions on the host, P groups of G rows, with their prompts and rewards."""

    rows: list[dict[str, Any]]  # the P prompt rows
    prompt_tokens: np.ndarray  # (P, Tp) left-padded, one row per group
    prompt_valid: np.ndarray  # (P, Tp)
    completions: Completions  # the B = P * G rows the engine drew (numpy)
    texts: list[str]  # the completions decoded, what the reward functions read
    rewards: np.ndarray  # (B,) NaN = excluded
    per_function: dict[str, np.ndarray]
    # episodes (train.agent): per row, the turns taken and the calls made, failed and made of each
    # tool ("turns", "calls", "errors", "tools/<name>/calls"); and the tool calls' wall time
    episode: dict[str, np.ndarray] | None = None
    tool_seconds: float = 0.0


def _episode_rows(eps: "episodes.Episodes", tool_names) -> dict[str, np.ndarray]:
    """Per row: turns, calls, errors and each tool's calls (Rollout.episode)."""
    out = {
        "turns": np.asarray(eps.turns, np.float64),
        "calls": np.asarray([len(c) for c in eps.calls], np.float64),
        "errors": np.asarray([sum(x.error for x in c) for c in eps.calls], np.float64),
    }
    for name in tool_names:
        out[f"tools/{name}/calls"] = np.asarray([sum(x.name == name for x in c) for c in eps.calls], np.float64)
    return out


def _repad(x: np.ndarray, width: int, fill) -> np.ndarray:
    """Left-pad (B, T) to (B, width): prompts of different buckets share one batch."""
    if x.shape[1] == width:
        return x
    out = np.full((x.shape[0], width), fill, x.dtype)
    out[:, width - x.shape[1] :] = x
    return out


def _select_groups(parts: list[Rollout], g: int, idx: list[tuple[int, int]], pad: int) -> Rollout:
    """Concatenate groups (part index, group index) from several sampling rounds."""
    width = max(p.prompt_tokens.shape[1] for p in parts)
    cat = lambda f: np.concatenate([f(parts[p], slice(j * g, (j + 1) * g)) for p, j in idx])
    one = lambda f: np.concatenate([f(parts[p], slice(j, j + 1)) for p, j in idx])
    groups = lambda *xs: np.concatenate([xs[p][j * g : (j + 1) * g] for p, j in idx])  # one field of every part
    return Rollout(
        rows=[parts[p].rows[j] for p, j in idx],
        prompt_tokens=one(lambda r, s: _repad(r.prompt_tokens[s], width, pad)),
        prompt_valid=one(lambda r, s: _repad(r.prompt_valid[s], width, False)),
        completions=jax.tree.map(groups, *(part.completions for part in parts)),
        texts=[c for p, j in idx for c in parts[p].texts[j * g : (j + 1) * g]],
        rewards=cat(lambda r, s: r.rewards[s]),
        per_function={
            k: np.concatenate([parts[p].per_function[k][j * g : (j + 1) * g] for p, j in idx])
            for k in parts[0].per_function
        },
        episode=None
        if parts[0].episode is None
        else {k: np.concatenate([parts[p].episode[k][j * g : (j + 1) * g] for p, j in idx]) for k in parts[0].episode},
        tool_seconds=sum(pt.tool_seconds for pt in parts),
    )


def sampling_setup(cfg: TrainConfig, tokenizer, eos_ids: Sequence[int] | None = None, toolbox=None):
    """(SamplerOptions, Turns or None) of a run: the sampler's options (stop at `eos_ids`, by default
    the tokenizer's), and with train.agent the episodes' turns (`toolbox` loaded when not given),
    whose tool calls end a turn too. The learner's process and the split rollout process make the same."""
    opts = SamplerOptions.from_config(
        cfg.sampling, eos_ids if eos_ids is not None else stop_ids(tokenizer), tokenizer.pad_token_id
    )
    if not cfg.agent.enabled:
        return opts, None
    turns = episodes.Turns.of(
        cfg.agent,
        tokenizer,
        toolbox if toolbox is not None else load_toolbox(cfg.agent),
        opts.eos_ids,
        opts.pad_id,
        cfg.sampling.prompt_buckets,
        cfg.sampling.max_new_tokens,
    )
    return dataclasses.replace(opts, eos_ids=turns.eos_ids), turns


# (prompt tokens, prompt valid, key) of a sampling round, before the engine draws it: compile its
# programs the first time a prompt shape appears, and serve the policy the round must draw with
BeforeRound = Callable[[np.ndarray, np.ndarray, Any], None]


class RolloutMaker:
    """Draws and scores one step's batch with whatever policy its engine serves (the caller makes
    it serve the right one: `before_round`). `timers` gets "rewards" (the reward functions' wall
    time) added; the caller owns and resets it."""

    def __init__(
        self,
        cfg: TrainConfig,
        tokenizer: Tokenizer,
        rewards: Sequence[rw.Reward],
        prompts: PromptSource,
        engine,
        opts,
        turns: "episodes.Turns | None",
        timers: dict[str, float],
        before_round: BeforeRound,
    ):
        self.cfg, self.tokenizer, self.rewards, self.prompts = cfg, tokenizer, list(rewards), prompts
        self.engine, self.opts, self.turns, self.timers, self.before_round = engine, opts, turns, timers, before_round

    def rollout(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """Sample P groups; with dynamic sampling keep only groups whose rewards differ, drawing
        more rounds (at most max_sampling_rounds) and topping up with zero-variance groups last."""
        g_cfg = self.cfg.grpo
        g, p = g_cfg.num_generations, g_cfg.prompts_per_step
        parts, keep, spare = [], [], []
        for round_ in range(g_cfg.max_sampling_rounds if g_cfg.dynamic_sampling else 1):
            part = self._sample_round(step, round_)
            parts.append(part)
            zero = algo.zero_std_groups(np.asarray(part.rewards, np.float32), g)
            if round_ == 0:
                first_zero = float(zero.mean())
            for j in range(p):
                (spare if g_cfg.dynamic_sampling and zero[j] else keep).append((round_, j))
            if len(keep) >= p:
                break
        chosen = (keep + spare)[:p]
        info = {
            "sampling_rounds": float(len(parts)),
            "frac_reward_zero_std": first_zero,
            "rollout_tokens": float(sum(int(pt.completions.lengths.sum()) for pt in parts)),
        }
        return (_select_groups(parts, g, chosen, self.opts.pad_id) if len(parts) > 1 else parts[0]), info

    def _sample_round(self, step: int, round_: int) -> Rollout:
        g, p = self.cfg.grpo.num_generations, self.cfg.grpo.prompts_per_step
        rows = self.prompts.sample(step, round_, p)
        encoded = [r["prompt_ids"] if "prompt_ids" in r else self.tokenizer.encode(r["prompt"]) for r in rows]
        ptok, pval = pad_prompts(encoded, self.cfg.sampling.prompt_buckets, self.opts.pad_id)
        self.before_round(ptok, pval, step_key(self.cfg.seed, step, round_))
        key = step_key(self.cfg.seed, step, round_)
        eps = None
        if self.turns is None:
            out = self.engine.generate(ptok, pval, key, g)  # host arrays
            texts = completion_texts(self.tokenizer, out.tokens, out.lengths, self.opts.eos_ids)
        else:  # episodes: turns of the engine's generate, tool calls between them
            eps, ptok, pval = episodes.run(
                self.engine.generate, self.turns, rows, ptok, pval, key, g, self._prompt_with
            )
            out, texts = eps.completions, eps.finals
        try:
            scored = self._score(step, round_, rows, out, texts, eps)
        finally:
            if eps is not None:
                eps.close()  # after the rewards: an environment's get_reward reads its instance
        return Rollout(
            rows=rows,
            prompt_tokens=ptok,
            prompt_valid=pval,
            completions=out,
            texts=texts,
            rewards=scored.total,
            per_function=scored.per_function,
            episode=None if eps is None else _episode_rows(eps, self.turns.toolbox.names),
            tool_seconds=0.0 if eps is None else eps.tool_seconds,
        )

    def _score(self, step: int, round_: int, rows, out: Completions, texts, eps) -> rw.RewardResult:
        """The rewards of one round's completions (or episodes: the built-ins score each final
        answer, a user's function the whole episode, with its tool calls and environment)."""
        prompts, completions, columns = rw.reward_inputs(
            rows,
            texts,
            repeat=self.cfg.grpo.num_generations,
            completion_ids=completion_ids(out.tokens, out.lengths),
            state=rw.TrainerState(global_step=step, max_steps=self.cfg.num_steps),
        )
        whole = None
        if eps is not None:
            columns.update(episodes.reward_columns(eps))
            whole = eps.messages if completions and isinstance(completions[0], list) else texts
        t_rew = time.perf_counter()
        scored = rw.score(
            self.rewards,
            prompts,
            completions,
            columns,
            timeout_s=self.cfg.reward_timeout_s,  # each function's call; RewardTimeout past it
            batch=f"the batch of step {step}" + (f" (sampling round {round_})" if round_ else ""),
            episodes=whole,
        )
        self.timers["rewards"] += time.perf_counter() - t_rew
        return scored

    def _prompt_with(self, row: dict[str, Any], observation: str) -> list[int]:
        """A row's prompt tokens with an environment's first observation added (episodes.run)."""
        return episodes.prompt_with(self.tokenizer, row, observation)
