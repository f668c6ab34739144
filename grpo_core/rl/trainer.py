"""The Python driver: rollout -> rewards -> advantages -> reference -> updates, once per step.

Everything heavy runs in the compiled sampler and learner; this loop only moves small arrays.
Its host syncs are deliberate and few per step: the sampled tokens (needed to decode text for
the reward functions) and the step's metrics at the end.

Determinism for resume: step s draws its prompts from `PromptSource.sample(s, round, n)` and its
PRNG key from (seed, s, round), so a run restored at step s continues exactly as it would have.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_core.agent import episodes
from grpo_core.agent.episodes import Turns
from grpo_core.agent.tools import Toolbox, load_toolbox
from grpo_core.config import memory as mem
from grpo_core.config.model import DType
from grpo_core.config.train import ISCorrection, RewardAggregation, TrainConfig
from grpo_core.engines import make_engine
from grpo_core.errors import NonFiniteError
from grpo_core.generate.sampler import (
    SamplerOptions,
    completion_ids,
    completion_texts,
    pad_prompts,
    spec_of,
    step_key,
    stop_ids,
)
from grpo_core.nn import lora
from grpo_core.nn.model import CausalLM
from grpo_core.rewards import functions as rw
from grpo_core.rewards import reward_model
from grpo_core.rl import algo
from grpo_core.rl.checkpoint import Checkpointer, SetAside
from grpo_core.rl.learner import Learner, LossParams, is_shapes
from grpo_core.rl.types import Batch, Completions, TrainState
from grpo_core.runtime.mesh import Placement

log = logging.getLogger(__name__)


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


@functools.lru_cache(maxsize=1)
def _learner(graphdef, opt_cfg, hp: LossParams, total_updates: int, ref_graphdef, placement) -> Learner:
    """The learner of these programs: a stage in a process that stayed for it (grpo_core.stages.ahead)
    finds the one the stage before built, its update and scorers traced and compiled, where a new
    Learner's would be traced and lowered again (its compilation only read back from the cache).
    Its state is the trainer's own; the learner holds programs, the optimizer and the layouts.
    Every argument is hashable: graphs, frozen config sections, the frozen placement."""
    return Learner(graphdef, opt_cfg, hp, total_updates, ref_graphdef, placement)


_rollout_weights = jax.jit(algo.rollout_weights, static_argnums=(3, 4))


class GRPOTrainer:
    """GRPO on one model. `train()` runs steps; `state` is what a checkpoint must hold."""

    def __init__(
        self,
        model: CausalLM,
        cfg: TrainConfig,
        tokenizer: Tokenizer,
        rewards: Sequence[rw.Reward],
        prompts: PromptSource,
        eos_ids: Sequence[int] | None = None,
        placement: Placement | None = None,
        memory_plan: "mem.Plan | None" = None,
        reference: CausalLM | None = None,
        toolbox: "Toolbox | None" = None,
    ):
        """`memory_plan` (grpo_core.config.memory.plan) chooses train.remat and grad_accum_steps where the
        config says auto; without one they are chosen here from this process's devices (the worker
        passes the plan it made for data.max_prompt_tokens). `reference`: the KL reference when it
        is not `model` as given (a continual run's original base, model.reference: base), a model
        of the same architecture without adapters. `toolbox`: the tools and environment of
        train.agent, loaded (grpo_core.agent.tools.load_toolbox; loaded here when not given).

        `model` may be shapes only (nnx.eval_shape, no LoRA, no reference kept): a trainer that
        resumes, whose state a checkpoint fills (`restore`), so the starting policy is never
        initialised or read only to be overwritten. It trains once a checkpoint restored, or after
        `start_from` a built model where none did."""
        if not rewards:
            raise ValueError("at least one reward function is needed")
        self.tokenizer, self.rewards, self.prompts = tokenizer, list(rewards), prompts
        self.graphdef, params = nnx.split(model)
        if is_shapes(params) and (lora.has_adapters(model) or (cfg.grpo.needs_reference and reference is None)):
            raise ValueError(
                "a trainer built from shapes restores its whole state from a checkpoint: with LoRA (the base "
                "weights) or a KL reference (the starting policy) it needs the built model"
            )
        # LoRA: the state trains the adapters; the base weights are a frozen argument of the step.
        self.frozen, ref_graphdef = None, None
        if lora.has_adapters(model):
            self.graphdef, ref_graphdef, self.frozen, params = lora.split(model)
        if not cfg.memory_resolved:
            memory_plan = memory_plan or self._plan(model.config, cfg, params)
            cfg = mem.resolve(cfg, memory_plan)
            log.info("memory: %s", memory_plan.describe())
        self.cfg, self.memory_plan = cfg, memory_plan
        # train.mesh: parameters (and the frozen base) laid out over the learner's devices, all hosts'.
        self.placement = placement or Placement.from_config(cfg.mesh)  # the one the model was loaded onto, if any
        # reward models (rewards[].model) on the reference's mesh in the run's dtype (the worker opened
        # them onto this placement already: nothing is loaded twice)
        reward_model.open_all(self.rewards, self.placement, model.config.dtype.value)
        params = self.placement.put_params(params)
        if self.frozen is not None:
            self.frozen = self.placement.put_params(self.frozen)
        g = cfg.grpo
        self.opts = SamplerOptions.from_config(
            cfg.sampling, eos_ids if eos_ids is not None else stop_ids(tokenizer), tokenizer.pad_token_id
        )
        hp = LossParams.from_train(cfg, model.config.dtype)
        total_updates = cfg.num_steps * g.num_iterations * g.minibatches_per_rollout
        self.learner = _learner(self.graphdef, cfg.optimizer, hp, total_updates, ref_graphdef, self.placement)
        # The reference is the starting policy, frozen (with LoRA: the base weights themselves,
        # adapters off, no copy), or the `reference` model given. With beta == 0 it is never kept
        # or scored.
        self.ref_params = None
        if g.needs_reference:
            if reference is not None:
                self.ref_params = self.placement.reference_params(
                    self.placement.put_params(nnx.state(reference)), copy=False
                )
            else:
                self.ref_params = self.placement.reference_params(
                    params if self.frozen is None else self.frozen, copy=self.frozen is None
                )
            self.ref_params = _in_compute_dtype(self.ref_params, model.config.dtype)
        # old_logp from the learner where the engine's numbers can differ from its own
        self.rescore = cfg.rollout.learner_logprobs(model.config.dtype)
        # the mismatch correction needs both log-probs: the engine's and the learner's rescoring
        self.is_mode = cfg.rollout.is_mode(model.config.dtype) if self.rescore else ISCorrection.OFF
        # with one update per rollout, in the update's own forward (its metrics come with the update's);
        # else in a pass of its own before the updates, which weigh the batch by its rollout_weight
        self.rescore_in_update = cfg.rescores_in_update(model.config.dtype)
        self.state: TrainState = self.learner.init_state(params)
        self.step = 0  # the next step to run
        self._compiled: dict[tuple[int, int], list] = {}  # prompt shape -> learner compile futures
        self._t = dict.fromkeys(
            ("rollout", "rewards", "reference", "update", "sync", "rescore"), 0.0
        )  # this step's split
        # The rollout engine (train.rollout): the built-in sampler reads self.params at each call;
        # sglang / http engines hold their own copy, sent by _sync_engine after every update.
        # train.agent: each row an episode of turns and tool calls (grpo_core.agent.episodes)
        self.turns = None
        if cfg.agent.enabled:
            self.turns = Turns.of(
                cfg.agent,
                tokenizer,
                toolbox if toolbox is not None else load_toolbox(cfg.agent),
                self.opts.eos_ids,
                self.opts.pad_id,
                cfg.sampling.prompt_buckets,
                cfg.sampling.max_new_tokens,
            )
            self.opts = dataclasses.replace(self.opts, eos_ids=self.turns.eos_ids)  # a call ends a turn too
        self.engine = make_engine(
            cfg.rollout,
            graphdef=self.graphdef,
            params_fn=lambda: self.params,
            model_config=model.config,
            opts=self.opts,
            batch_size=g.batch_size,
            tokenizer=tokenizer,
            seed=cfg.seed,
            placement=self.placement,
        )

    def _plan(self, mc, cfg: TrainConfig, params) -> "mem.Plan":
        """A memory plan from this process's devices, for prompts of up to 64 tokens (the worker
        plans with data.max_prompt_tokens instead and passes it in)."""
        facts = mem.device_facts()
        trainable = None if self.frozen is None else lora.num_params(params)
        layout = mem.Layout() if facts["backend"] == "cpu" else mem.Layout(*cfg.mesh.sizes(facts["devices"]))
        return mem.plan(
            mc,
            cfg,
            64,
            facts["available"],
            trainable=trainable,
            layout=layout,
            backend=facts["backend"],
            runtime_bytes=facts["runtime"],
            reward_models=reward_model.shapes(self.rewards, mc.dtype.value),
        )

    @property
    def params(self):
        """The policy's parameters (with LoRA: the base and the adapters, one nnx.State)."""
        if self.frozen is None:
            return self.state["params"]
        return nnx.merge_state(self.frozen, self.state["params"])

    def model(self) -> CausalLM:
        return nnx.merge(self.graphdef, self.params)

    # -- compilation -----------------------------------------------------------------------

    def _precompile(self, ptok: np.ndarray, pval: np.ndarray, key) -> None:
        """The first time a prompt bucket appears, compile the sampler, the reference scorer and
        the update step for it concurrently (a cold first step otherwise compiles them one after
        another). The sampler's compilation is waited for here; the learner's in `_wait_compiled`."""
        if ptok.shape in self._compiled:
            return
        g_cfg, n = self.cfg.grpo, self.opts.max_new_tokens
        b = g_cfg.batch_size
        per_token = lambda dtype: jax.ShapeDtypeStruct((b, n), dtype)
        batch_spec = spec_of(
            Batch(
                prompt_tokens=ptok,
                prompt_valid=pval,
                targets=per_token(jnp.int32),
                mask=per_token(jnp.float32),
                advantages=jax.ShapeDtypeStruct((b,), jnp.float32),
                old_logp=per_token(jnp.float32),
                ref_logp=per_token(jnp.float32),
                rollout_weight=per_token(jnp.float32) if self._weighs_batch else None,
            )
        )
        sampler_jobs = self.engine.compile_jobs(ptok, pval, key, g_cfg.num_generations)
        learner_jobs = self.learner.compile_jobs(
            self.state, batch_spec, g_cfg.minibatches_per_rollout, g_cfg.needs_reference, self.frozen, self.ref_params
        )
        pool = ThreadPoolExecutor(max_workers=len(sampler_jobs) + len(learner_jobs))
        self._compiled[ptok.shape] = [pool.submit(job) for job in learner_jobs]  # the longest first
        for f in [pool.submit(job) for job in sampler_jobs]:
            f.result()
        pool.shutdown(wait=False)  # its threads finish the learner's jobs, then exit

    def _wait_compiled(self) -> None:
        """Block until background compilation is done (a call before it would compile again)."""
        for futures in self._compiled.values():
            for f in futures:
                f.result()  # raises what compilation raised

    # -- rollout ---------------------------------------------------------------------------

    def _sample_round(self, step: int, round_: int) -> Rollout:
        g, p = self.cfg.grpo.num_generations, self.cfg.grpo.prompts_per_step
        rows = self.prompts.sample(step, round_, p)
        encoded = [r["prompt_ids"] if "prompt_ids" in r else self.tokenizer.encode(r["prompt"]) for r in rows]
        ptok, pval = pad_prompts(encoded, self.cfg.sampling.prompt_buckets, self.opts.pad_id)
        self._precompile(ptok, pval, step_key(self.cfg.seed, step, round_))
        if self.engine.synced_step != self.step:  # a new trainer or a restored checkpoint
            self._sync_engine(self.step)
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
        self._t["rewards"] += time.perf_counter() - t_rew
        return scored

    def _prompt_with(self, row: dict[str, Any], observation: str) -> list[int]:
        """A row's prompt tokens with an environment's first observation added (episodes.run)."""
        return episodes.prompt_with(self.tokenizer, row, observation)

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

    # -- learning --------------------------------------------------------------------------

    def _batch(self, ro: Rollout) -> Batch:
        c = ro.completions
        g_cfg, n = self.cfg.grpo, c.tokens.shape[1]  # a completion's tokens, or an episode's (train.agent)
        if g_cfg.multi_objective_aggregation is RewardAggregation.NORMALIZE_THEN_SUM:
            per = np.stack([ro.per_function[r.name] for r in self.rewards], axis=1).astype(np.float32)
            weights = np.asarray([r.weight for r in self.rewards], np.float32)
            adv = algo.normalize_then_sum(per, weights, g_cfg.num_generations, g_cfg.advantage_eps)
        else:  # B floats, in NumPy on the host (algo): the batch goes up whole
            adv = algo.advantages(
                np.asarray(ro.rewards, np.float32),
                g_cfg.num_generations,
                g_cfg.advantage,
                g_cfg.scale_rewards,
                g_cfg.advantage_eps,
            )
        mask = np.arange(n)[None, :] < c.lengths[:, None]
        if c.trained is not None:  # an episode's tool results and template glue: context, never trained
            mask &= c.trained
        if g_cfg.mask_truncated_completions:
            mask &= ~c.truncated[:, None]
        mask &= ~np.isnan(ro.rewards)[:, None]  # no reward function applies: no loss
        b = len(c.tokens)
        batch = Batch(  # each prompt once: the learner runs it once per group
            prompt_tokens=ro.prompt_tokens,
            prompt_valid=ro.prompt_valid,
            targets=c.tokens,
            mask=mask.astype(np.float32),
            advantages=adv,
            old_logp=c.logprobs.astype(np.float32),
            ref_logp=np.zeros((b, n), np.float32),
        )
        return self.placement.put_batch(batch)  # rows over the mesh; the same host arrays on every process

    def _update(self, step: int, batch: Batch) -> dict[str, jax.Array]:
        g_cfg = self.cfg.grpo
        m, g, p = g_cfg.minibatches_per_rollout, g_cfg.num_generations, g_cfg.prompts_per_step
        per = []
        for it in range(g_cfg.num_iterations):
            order = batch
            if m > 1:  # fresh group order per pass, from (seed, step, pass): reproducible on resume
                perm = jax.random.permutation(jax.random.fold_in(step_key(self.cfg.seed, step, 1 << 20), it), p)
                rows = (perm[:, None] * g + jnp.arange(g)[None, :]).reshape(-1)
                order = batch.map_rows(lambda x: x[perm], lambda x: x[rows])
            for k in range(m):  # contiguous slices keep every group whole
                mb = (
                    jax.tree.map(lambda x: x[k * x.shape[0] // m : (k + 1) * x.shape[0] // m], order)
                    if m > 1
                    else order
                )
                self.state, metrics = self.learner.update(self.state, self.placement.put_batch(mb), self.frozen)
                per.append(metrics)
        return jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs)), *per) if len(per) > 1 else per[0]

    def train_step(self) -> dict[str, float]:
        """Run step `self.step` and return its metrics (floats)."""
        if is_shapes(self.state):  # built from shapes: a checkpoint, or start_from, fills it first
            raise RuntimeError("this trainer was built from shapes: restore a checkpoint, or start_from a model, first")
        step = self.step
        self._t = dict.fromkeys(self._t, 0.0)
        t0 = time.perf_counter()
        ro, info = self.rollout(step)
        self._t["rollout"] = time.perf_counter() - t0 - self._t["rewards"] - self._t["sync"]
        batch = self._batch(ro)
        self._wait_compiled()
        if self.rescore and not self.rescore_in_update:
            t = time.perf_counter()
            behaviour = self.learner.score_policy(self.params, batch).block_until_ready()  # the current policy's
            weights, mismatch = _rollout_weights(
                behaviour, batch.old_logp, batch.mask, self.is_mode, self.cfg.rollout.is_cap
            )
            batch = batch._replace(old_logp=behaviour, rollout_weight=weights if self._weighs_batch else None)
            info.update(mismatch)  # read with the step's metrics: no sync here
            self._t["rescore"] = time.perf_counter() - t
        if self.ref_params is not None:
            t = time.perf_counter()
            batch = batch._replace(ref_logp=self.learner.score(self.ref_params, batch).block_until_ready())
            self._t["reference"] = time.perf_counter() - t
        t = time.perf_counter()
        learner_metrics = jax.device_get(self._update(step, batch))  # host sync: the step's end
        self._t["update"] = time.perf_counter() - t
        self._sync_engine(step + 1)  # the engine serves the updated policy from the next rollout on
        metrics = self._metrics(step, ro, info, learner_metrics)
        metrics["time/step"] = time.perf_counter() - t0
        self.step += 1
        return metrics

    @property
    def _weighs_batch(self) -> bool:
        """Whether the update reads the mismatch correction's weights from the batch (rescored in a pass of its own)."""
        return self.is_mode is not ISCorrection.OFF and not self.rescore_in_update

    def _sync_engine(self, version: int) -> None:
        """Send the policy after `version` updates to the rollout engine (bounded by
        train.rollout.sync_timeout_s inside the engine). LoRA adapters are merged first: the
        engines serve plain models."""
        t = time.perf_counter()
        params = None
        if self.engine.name != "jax":
            params = self.params if self.frozen is None else nnx.state(lora.merge(self.model()), nnx.Param)
        self.engine.sync(params, version)
        self._t["sync"] += time.perf_counter() - t

    def close(self) -> None:
        """Stop the rollout engine (an in-process engine's threads, or a server this run started)."""
        self.engine.close()

    def _metrics(self, step, ro: Rollout, info, lm) -> dict[str, float]:
        r = ro.rewards[~np.isnan(ro.rewards)]
        out = {"step": float(step), "reward": _mean(r), "reward_std": _std(r)}
        # Rows some reward scored; the others have no loss. 0 means the step learned nothing
        # (loss and grad norm 0, reward NaN): say so rather than let it pass as a quiet step.
        out["frac_rows_scored"] = len(r) / max(1, len(ro.rewards))
        if not len(r):
            log.warning(
                "step %d: no reward scored any of its %d completions (every reward returned None): "
                "the step learned nothing",
                step,
                len(ro.rewards),
            )
        for name, v in ro.per_function.items():
            v = v[~np.isnan(v)]
            out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = _mean(v), _std(v)
        out.update({k: float(v) for k, v in info.items() if k.startswith(("logprobs/", "rollout_is/"))})
        out["frac_reward_zero_std"] = info["frac_reward_zero_std"]
        out["sampling_rounds"] = info["sampling_rounds"]
        lengths = ro.completions.lengths
        if ro.completions.trained is not None:  # the model's own tokens of each episode, as TRL counts them
            lengths = ro.completions.trained.sum(axis=1)
        if ro.episode is not None:
            b = len(ro.episode["turns"])
            out["turns_per_episode"] = float(ro.episode["turns"].mean())
            out["tool_calls_per_episode"] = float(ro.episode["calls"].sum()) / b
            out["tool_errors_per_episode"] = float(ro.episode["errors"].sum()) / b
            out["episodes/truncated_ratio"] = float(ro.completions.truncated.mean())
            out.update({k: float(v.sum()) / b for k, v in ro.episode.items() if k.startswith("tools/")})
            out["time/tools"] = ro.tool_seconds
        out["completions/mean_length"] = float(lengths.mean())
        out["completions/min_length"] = float(lengths.min())
        out["completions/max_length"] = float(lengths.max())
        out["completions/clipped_ratio"] = float(ro.completions.truncated.mean())
        out.update({k: float(v) for k, v in lm.items()})
        out["rollout_tokens_per_s"] = info["rollout_tokens"] / max(self._t["rollout"], 1e-9)
        out.update({f"time/{k}": v for k, v in self._t.items()})
        for k in ("loss", "grad_norm", "kl", "entropy"):
            if not math.isfinite(out[k]):
                raise NonFiniteError(
                    f"step {step}: {k} is {out[k]} (learning_rate={out['learning_rate']:.3g}, "
                    f"grad_norm={out['grad_norm']:.3g}); lower optimizer.learning_rate or check the rewards"
                )
        return out

    # -- checkpoints -----------------------------------------------------------------------

    def save(self, ckpt: Checkpointer, config_hash: str = "") -> None:
        """Checkpoint after `self.step` steps. The reference policy is not saved: it is the model
        this trainer was built from, which a resumed run builds again from the same source; with
        LoRA neither is the base (the state holds the adapters only)."""
        ckpt.save(self.step, self.state, {"seed": self.cfg.seed, "config_hash": config_hash})

    def restore(
        self,
        ckpt: Checkpointer,
        step: int | None = None,
        config_hash: str = "",
        on_set_aside: Callable[[SetAside], None] | None = None,
    ) -> bool:
        """Continue from checkpoint `step`, or by default from the newest finalised one that
        restores. False if none.

        Resuming (no `step`): a checkpoint that fails to restore is set aside (moved under the
        checkpoints folder's _set_aside/, see Checkpointer.restore_newest), reported to
        `on_set_aside` and the next older one tried; with every one set aside the run starts
        from step 0, which each report says. An explicit `step` is a request, not a resume:
        nothing is moved and an unreadable checkpoint raises UnreadableCheckpointError naming
        its folder. Either way a checkpoint of another run (seed or config hash) raises ValueError."""

        def ours(s: int, meta: dict[str, Any]) -> None:
            if meta.get("seed") != self.cfg.seed or meta.get("config_hash", "") != config_hash:
                raise ValueError(
                    f"checkpoint {s} in {ckpt.directory} was written by another run "
                    f"(seed {meta.get('seed')}, config {meta.get('config_hash')!r}); this run has seed "
                    f"{self.cfg.seed}, config {config_hash!r}"
                )

        if step is not None:
            state, meta = ckpt.restore(step, self.state)
            ours(step, meta)
        else:
            found = ckpt.restore_newest(self.state, check=ours, on_set_aside=on_set_aside)
            if found is None:
                return False
            _, state, meta = found
        self.state, self.step = state, int(meta["step"])
        return True

    def start_from(self, model: CausalLM) -> None:
        """Step 0 of the starting policy `model` (built: arrays) with fresh optimizer moments, for
        a trainer built from shapes that found no checkpoint to restore after all (every one set
        aside as unreadable)."""
        _, params = nnx.split(model)
        self.state = self.learner.init_state(params)  # laid out over the learner's mesh there
        self.step = 0

    def train(
        self, num_steps: int | None = None, on_step: Callable[[dict[str, float]], None] | None = None
    ) -> list[dict[str, float]]:
        """Run until `num_steps` steps in total have run (default: the config's num_steps)."""
        end = self.cfg.num_steps if num_steps is None else num_steps
        history = []
        while self.step < end:
            m = self.train_step()
            history.append(m)
            if on_step is not None:
                on_step(m)
        return history


def _in_compute_dtype(params, dtype: DType):
    """The reference's weights as the matmuls read them: every matrix in the compute dtype (a
    bfloat16 run with float32 master weights keeps a bfloat16 reference, half the memory and the
    same numbers), vectors (norm scales, biases) as they are."""
    if dtype is not DType.BFLOAT16:
        return params
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.ndim >= 2 and x.dtype == jnp.float32 else x, params)


def _mean(x):
    return float(np.mean(x)) if len(x) else float("nan")


def _std(x):
    return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0
