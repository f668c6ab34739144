"""The Python driver: rollout -> rewards -> advantages -> reference -> updates, once per step.

Everything heavy runs in the compiled sampler and learner; this loop only moves small arrays.
Its host syncs are deliberate and few per step: the sampled tokens (needed to decode text for
the reward functions) and the step's metrics at the end.

Determinism for resume: step s draws its prompts from `PromptSource.sample(s, round, n)` and its
PRNG key from (seed, s, round), so a run restored at step s continues exactly as it would have.
With train.max_staleness = k >= 1 the batch of step s is drawn by the policy after max(0, s - k)
updates, ahead of the learner (grpo_core.rl.overlap); the batches a checkpoint's versions cannot
draw again are saved in it.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_core.agent.tools import Toolbox
from grpo_core.config import memory as mem
from grpo_core.config.model import DType
from grpo_core.config.train import ISCorrection, RewardAggregation, RolloutLayout, TrainConfig
from grpo_core.engines import make_engine
from grpo_core.errors import ConfigError, NonFiniteError
from grpo_core.generate.sampler import spec_of, step_key
from grpo_core.nn import lora
from grpo_core.nn.model import CausalLM
from grpo_core.rewards import functions as rw
from grpo_core.rewards import reward_model
from grpo_core.rl import algo, overlap, split
from grpo_core.rl.checkpoint import AHEAD, Checkpointer, SetAside
from grpo_core.rl.learner import Learner, LossParams, is_shapes
from grpo_core.rl.rollouts import PromptSource, Rollout, RolloutMaker, Tokenizer, sampling_setup
from grpo_core.rl.types import Batch, TrainState
from grpo_core.runtime.mesh import Placement

log = logging.getLogger(__name__)


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
        rollout_argv: Sequence[str] | None = None,
    ):
        """`memory_plan` (grpo_core.config.memory.plan) chooses train.remat and grad_accum_steps where the
        config says auto; without one they are chosen here from this process's devices (the worker
        passes the plan it made for data.max_prompt_tokens). `reference`: the KL reference when it
        is not `model` as given (a continual run's original base, model.reference: base), a model
        of the same architecture without adapters. `toolbox`: the tools and environment of
        train.agent, loaded (grpo_core.agent.tools.load_toolbox; loaded here when not given).
        `rollout_argv`: with train.rollout.layout=split, the arguments that tell the rollout process
        (grpo_core.stages.rollout) which run to read (`--root URL [--config FILE]`: the worker's own).

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
        self._compile_lock = threading.Lock()  # the rollout side asks for the learner's programs too
        self._t = dict.fromkeys(
            ("rollout", "rewards", "reference", "update", "sync", "rescore"), 0.0
        )  # this step's split
        # The rollout engine (train.rollout): the built-in sampler reads self.params at each call;
        # sglang / http engines hold their own copy, sent by _sync_engine after every update.
        # train.agent: each row an episode of turns and tool calls (grpo_core.agent.episodes)
        self.opts, self.turns = sampling_setup(cfg, tokenizer, eos_ids, toolbox)
        self.model_config = model.config
        self.engine = self._engine(lambda: self.params)
        self.maker = RolloutMaker(
            cfg, tokenizer, rewards, prompts, self.engine, self.opts, self.turns, self._t, self._before_round
        )
        # Where each step's batch comes from (grpo_core.rl.overlap): drawn when the step asks for it
        # (k = 0, colocated: the synchronous run), or ahead by a thread or a process of its own.
        self.until = cfg.num_steps  # the last step this process trains (the worker sets its epoch's end)
        self._held: list[overlap.Made] = []  # the batches ahead a restored checkpoint kept
        self._state_spec = None  # the state's shapes, for compiling the learner from the rollout side's thread
        self.source = self._source(rollout_argv)

    def _engine(self, params_fn):
        return make_engine(
            self.cfg.rollout,
            graphdef=self.graphdef,
            params_fn=params_fn,
            model_config=self.model_config,
            opts=self.opts,
            batch_size=self.cfg.grpo.batch_size,
            tokenizer=self.tokenizer,
            seed=self.cfg.seed,
            placement=self.placement,
        )

    def _source(self, rollout_argv):
        """The rollout side train.max_staleness and train.rollout.layout ask for (grpo_core.rl.overlap)."""
        cfg, k = self.cfg, self.cfg.max_staleness
        if cfg.rollout.layout is RolloutLayout.COLOCATED and k == 0:
            return overlap.Inline(self.maker)
        if jax.process_count() > 1:
            raise ConfigError(
                f"train.max_staleness={k} / train.rollout.layout={cfg.rollout.layout.value} runs on one host for now; "
                f"this run has {jax.process_count()} processes: use max_staleness 0 and layout colocated"
            )
        if cfg.rollout.layout is RolloutLayout.SPLIT:
            if jax.default_backend() != "cpu":
                raise ConfigError(
                    "train.rollout.layout=split starts a second process on CPU cores of its own, on the CPU backend "
                    f"only for now (this one is {jax.default_backend()}): use layout colocated here; grpo check "
                    "--target estimates a split of a TPU's chips"
                )
            if rollout_argv is None:
                raise ConfigError(
                    "train.rollout.layout=split needs a run root for its rollout process to read: run it through "
                    "the worker (grpo run, grpo train), not a trainer built in this process"
                )
            return split.Split(
                list(rollout_argv),
                k,
                self._host_policy,
                self._compile_learner,
                self.model_config,
                cfg.rollout,
            )
        slot: list = [None]
        timers = {"rewards": 0.0}
        engine = self._engine(lambda: slot[0])
        maker = RolloutMaker(
            cfg, self.tokenizer, self.rewards, self.prompts, engine, self.opts, self.turns, timers,
            lambda ptok, pval, key: self._before_round_ahead(engine, ptok, pval, key),
        )  # fmt: skip
        score = self._score_behaviour if self.rescore else None
        return overlap.Colocated(maker, slot, k, self._snapshot, score)

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
        sampler_jobs = self.engine.compile_jobs(ptok, pval, key, self.cfg.grpo.num_generations)
        learner_jobs = self._learner_jobs(ptok.shape, self.state)
        pool = ThreadPoolExecutor(max_workers=len(sampler_jobs) + len(learner_jobs))
        self._compiled[ptok.shape] = [pool.submit(job) for job in learner_jobs]  # the longest first
        for f in [pool.submit(job) for job in sampler_jobs]:
            f.result()
        pool.shutdown(wait=False)  # its threads finish the learner's jobs, then exit

    def _learner_jobs(self, shape: tuple[int, int], state) -> list:
        """The learner's compilations (update, reference) for batches of prompts of `shape` (P, Tp)."""
        g_cfg, n = self.cfg.grpo, self.opts.max_new_tokens
        b = g_cfg.batch_size
        per_token = lambda dtype: jax.ShapeDtypeStruct((b, n), dtype)
        batch_spec = spec_of(
            Batch(
                prompt_tokens=jax.ShapeDtypeStruct(shape, jnp.int32),
                prompt_valid=jax.ShapeDtypeStruct(shape, jnp.bool_),
                targets=per_token(jnp.int32),
                mask=per_token(jnp.float32),
                advantages=jax.ShapeDtypeStruct((b,), jnp.float32),
                old_logp=per_token(jnp.float32),
                ref_logp=per_token(jnp.float32),
                rollout_weight=per_token(jnp.float32) if self._weighs_batch else None,
            )
        )
        return self.learner.compile_jobs(
            state, batch_spec, g_cfg.minibatches_per_rollout, g_cfg.needs_reference, self.frozen, self.ref_params
        )

    def _compile_learner(self, shape: tuple[int, ...]) -> None:
        """Start compiling the learner's programs for a prompt shape the rollout side met first
        (called from its thread, or the split process's reader), unless done or under way."""
        with self._compile_lock:
            if tuple(shape) in self._compiled:
                return
            jobs = self._learner_jobs(tuple(shape), self._state_spec)
            pool = ThreadPoolExecutor(max_workers=len(jobs))
            self._compiled[tuple(shape)] = [pool.submit(job) for job in jobs]
            pool.shutdown(wait=False)

    def _wait_compiled(self) -> None:
        """Block until background compilation is done (a call before it would compile again)."""
        with self._compile_lock:
            pending = list(self._compiled.values())
        for futures in pending:
            for f in futures:
                f.result()  # raises what compilation raised

    # -- rollout ---------------------------------------------------------------------------

    def _before_round(self, ptok: np.ndarray, pval: np.ndarray, key) -> None:
        """Before each sampling round of a synchronous step: its programs, and the current policy served."""
        self._precompile(ptok, pval, key)
        if self.engine.synced_step != self.step:  # a new trainer or a restored checkpoint
            self._sync_engine(self.step)

    def _before_round_ahead(self, engine, ptok: np.ndarray, pval: np.ndarray, key) -> None:
        """Before each round the colocated thread draws: the sampler's programs compiled there, the
        learner's started beside them."""
        if ptok.shape in self._compiled:
            return
        self._compile_learner(ptok.shape)
        for job in engine.compile_jobs(ptok, pval, key, self.cfg.grpo.num_generations):
            job()

    def rollout(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """Step `step`'s batch drawn now by the current policy (RolloutMaker.rollout)."""
        return self.maker.rollout(step)

    def _snapshot(self, trainable):
        """A copy of the policy for the colocated thread (each update donates the learner's arrays)."""
        copy = jax.tree.map(jnp.copy, trainable)
        return copy if self.frozen is None else nnx.merge_state(self.frozen, copy)

    def _host_policy(self, trainable):
        """The policy as numpy, for the split rollout process: a plain model (LoRA merged), as the
        other engines are sent it."""
        params = trainable
        if self.frozen is not None:
            params = nnx.state(lora.merge(nnx.merge(self.graphdef, self.frozen, trainable)), nnx.Param)
        return jax.device_get(nnx.to_pure_dict(params))

    def _score_behaviour(self, params, ro: Rollout) -> np.ndarray:
        """The drawing policy's log-probs of a batch in the learner's numerics (the colocated thread,
        which holds that version): old_logp where the learner would rescore the sampler's."""
        batch = {"prompt_tokens": ro.prompt_tokens, "prompt_valid": ro.prompt_valid, "targets": ro.completions.tokens}
        return np.asarray(jax.device_get(self.learner.score_policy(params, self.placement.put_batch(batch))))

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
        for k in self._t:
            self._t[k] = 0.0
        t0 = time.perf_counter()
        if not self.source.started:
            self._state_spec = spec_of(self.state)
            end = min(self.cfg.num_steps, self.until + self.cfg.max_staleness)
            self.source.start(step, self.state["params"], self._held, end)
        made, waited = self.source.take(step)  # the batch of this step, drawn by version made.version
        ro, info = made.rollout, made.info
        if self.source.inline:
            self._t["rollout"] = time.perf_counter() - t0 - self._t["rewards"] - self._t["sync"]
        else:
            self._t.update(rollout=made.seconds["rollout"], rewards=made.seconds["rewards"])
            self._compile_learner(ro.prompt_tokens.shape)  # rounds of several prompt widths make a wider batch
        batch = self._batch(ro)
        self._wait_compiled()
        if self.rescore and not self.rescore_in_update:
            t = time.perf_counter()
            if made.behaviour_logp is None:  # drawn by the current policy: scored here
                behaviour = self.learner.score_policy(self.params, batch).block_until_ready()
            else:  # drawn by an older one: scored by the side that held it
                behaviour = self.placement.put_batch(np.asarray(made.behaviour_logp, np.float32))
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
        if self.source.inline:
            self._sync_engine(step + 1)  # the engine serves the updated policy from the next rollout on
        else:
            t = time.perf_counter()
            self.source.publish(step + 1, self.state["params"])  # the rollout side draws with it from now on
            self._t["sync"] = time.perf_counter() - t
        metrics = self._metrics(step, ro, info, learner_metrics)
        if not self.source.inline:
            metrics.update(
                {
                    "async/version": float(made.version),
                    "async/staleness": float(step - made.version),  # versions behind the policy it updates
                    "async/learner_wait_s": waited,  # the learner waiting for this batch
                    "async/rollout_wait_s": made.seconds["wait"],  # the rollout side waiting for its version
                    "async/rollout_busy_s": made.seconds["rollout"] + made.seconds["rewards"] + made.seconds["score"],
                }
            )
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
        """Stop the rollout side (a thread, or the split layout's process) and the rollout engine (an
        in-process engine's threads, or a server this run started)."""
        try:
            self.source.close()
        finally:
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
        ahead = None
        if not self.source.inline:  # drawn by versions before this step, which the checkpoint does not hold
            batches = self.source.ahead(self.step) if self.source.started else self._held
            ahead = overlap.to_saved(batches) if batches else None
        ckpt.save(self.step, self.state, {"seed": self.cfg.seed, "config_hash": config_hash}, ahead=ahead)

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
        self._held = overlap.from_saved(*meta[AHEAD]) if AHEAD in meta else []
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
