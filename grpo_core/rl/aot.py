"""Ahead-of-time compilation of a run's programs for a TPU slice that is not here, and XLA's own
memory figures for them: how MaxText's train_compile.py checks a pod before anyone rents it.

With `libtpu` installed, `jax.experimental.topologies.get_topology_desc` gives the devices of a
topology (`v5e:2x2`) on any x86 host; a mesh over them, arrays described by ShapeDtypeStructs
carrying their shardings (the model from `nnx.eval_shape`, Adam's moments from
`jax.eval_shape(tx.init, ...)`) and `jit(...).lower(...).compile()` run the real TPU compiler.
Nothing is allocated: a 0.5 B model compiles in about a minute on 2 cores and under 2.5 GB of RAM.

The programs are the ones the run executes (grpo_core.rl.trainer, .evaluation), built by the
same code with the same meshes (grpo_core.runtime.mesh.Placement) and shardings:

    update        Learner.update: one optimizer update over a minibatch, accumulation inside
    reference     the KL reference's log-probs (beta > 0)
    old_logprobs  the policy's log-probs of its own samples (when the learner rescores them in a pass of
                  their own: with one update per rollout the update's forward scores them)
    prefill       the sampler's prompt pass and first token, KV cache laid out on the rollout mesh
    decode        the sampler's decode loop over that cache
    eval_prefill, eval_decode   evaluation's generate (eval.batch_size prompts x eval.num_samples),
                  over the rollout's mesh as the evaluation worker lays it out
    reward_model  a reward model's scoring of one batch (rewards[].batch_size x max_length), on the
                  reference's mesh (reward_model_1, ... for a second one)

XLA's figures are per chip (one SPMD program). A chip also holds, during each program, the run's
arrays that are not its arguments (the optimizer state while the sampler runs, the reference's
weights while the update runs): `resident_bytes` adds them, and `peak_bytes` is the sum.

The same figures bound the time: each program's FLOPs and bytes with its loops counted
(grpo_core.rl.hlo_cost) against the chip's peaks give a step's and a run's roofline bound
(grpo_core.config.roofline), the report's `estimate`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from grpo_core.config import memory, roofline
from grpo_core.config.model import DType, ModelConfig
from grpo_core.config.target import MEGACORE, Target
from grpo_core.config.train import ISCorrection, MeshConfig, RematPolicy, RolloutLayout, TrainConfig
from grpo_core.errors import ConfigError
from grpo_core.generate import sampler
from grpo_core.nn import lora as lora_mod
from grpo_core.nn.model import create_model
from grpo_core.nn.reward_model import SequenceClassifier, score_lowered
from grpo_core.rl import hlo_cost
from grpo_core.rl.learner import Learner, LossParams
from grpo_core.rl.types import Batch, TrainState
from grpo_core.runtime.mesh import Placement

log = logging.getLogger(__name__)

# A program fits when its chip peak is at most this share of the chip's HBM: XLA's figures are
# exact for the program, the rest is the runtime's own reservations (v5e: 15.75 of 16 GiB) and
# fragmentation between programs.
HEADROOM = 0.95
# update candidates the formula says need more than this share of the usable HBM are not compiled.
# bench.aot's candidates put it at 0.88-1.06x XLA's chip peak (before the model laid its activations
# out over the chips, 0.75-1.58x), so the cut leaves a wide margin; a candidate that does not fit
# costs little to compile, XLA:TPU refuses it at its first memory check (3-8 s)
FORMULA_SKIP = 2.0
_HOST_BOUNDS = (2, 2, 1)  # the compiler's default chips per host
# What _figures computes, in every ProgramCache key: its version (bumped when it adds or changes a
# figure) and the loop counter's source, so that figures cached before either changed are not read back
FIGURES_VERSION = 2  # 2: the FLOPs and bytes with the loops counted (hlo_cost)
with open(hlo_cost.__file__, "rb") as _f:
    _FIGURES = f"figures {FIGURES_VERSION} {hashlib.sha256(_f.read()).hexdigest()[:16]}"
INSTALL = "pip install -c constraints.txt '.[tpu-aot]'  (libtpu==0.0.42.*, the libtpu jax 0.10.2 pairs with)"


class AOTUnavailableError(ConfigError):
    """libtpu (XLA's TPU compiler) is not installed in this interpreter: the message says what to install."""


def topology_devices(target: Target) -> list:
    """The devices of `target`, as the TPU compiler sees them (no TPU needed)."""
    kw: dict[str, Any] = {"chip_config_name": "megacore"} if target.generation in MEGACORE else {}
    if target.num_slices > 1:
        kw["num_slices"] = target.num_slices
    shape = (*target.shape, 1, 1)[:3]
    if any(n < d for n, d in zip(shape, _HOST_BOUNDS)):  # smaller than one host (v5e:1x1): a host of that size
        kw["chips_per_host_bounds"] = tuple(min(n, d) for n, d in zip(shape, _HOST_BOUNDS))
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=target.name, **kw)
    except RuntimeError as exc:
        if "not installed" in str(exc):
            raise AOTUnavailableError(f"XLA's TPU compiler is not installed: {INSTALL}") from None
        raise ConfigError(f"pipeline.readiness.target {target.name!r}: {exc}") from None
    return list(topo.devices)


def chip_bytes(tree) -> int:
    """Bytes one chip holds of a tree of ShapeDtypeStructs (the largest shard of each leaf)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def _laid(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


# XLA:TPU's two ways of saying a program does not fit: "Ran out of memory in memory space hbm.
# Used 59.70G of 15.75G hbm" and "the total memory required for HLO temporaries (30.83G) exceeds
# available HBM (15.75G)"
_OOM = (
    re.compile(r"Used\s+([\d.]+)([KMGT]?)i?B?\s+of\s+([\d.]+)([KMGT]?)i?B?\s+hbm", re.IGNORECASE),
    re.compile(r"\(([\d.]+)([KMGT]?)i?B?\)\s+exceeds available HBM\s+\(([\d.]+)([KMGT]?)i?B?\)", re.IGNORECASE),
)
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _oom_bytes(text: str) -> tuple[int, int] | None:
    """(needed, capacity) from XLA:TPU's refusal of a program that does not fit in HBM."""
    for pattern in _OOM:
        m = pattern.search(text)
        if m:
            used, uu, cap, cu = m.groups()
            return int(float(used) * _UNIT[uu.upper()]), int(float(cap) * _UNIT[cu.upper()])
    return None


class ProgramCache:
    """XLA's figures per program, keyed by the program itself: its lowered module's text (shapes,
    shardings, donations, the computation), the target and the compiler's versions (`salt`) and
    what _figures computes (FIGURES_VERSION, hlo_cost's source).
    A check whose config changes only evaluation finds the update's figures here and compiles only
    evaluation; two programs that lower to the same module in one check (evaluation's generate and
    the rollout's at equal shapes) compile once. `folder`: where the figures are kept across
    processes (None: this process only)."""

    def __init__(self, folder: str | None = None, salt: str = ""):
        self.folder, self.salt = folder, salt
        self._mem: dict[str, dict[str, Any]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def key(self, text: str) -> str:
        return hashlib.sha256(f"{_FIGURES}\n{self.salt}\n{text}".encode()).hexdigest()[:32]

    def lock(self, key: str) -> threading.Lock:
        """Held while `key` compiles: a second thread with the same program waits for its figures."""
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def get(self, key: str) -> dict[str, Any] | None:
        if key in self._mem or self.folder is None:
            return self._mem.get(key)
        try:
            with open(os.path.join(self.folder, f"{key}.json")) as f:
                self._mem[key] = json.load(f)
        except (OSError, json.JSONDecodeError):
            return None
        return self._mem[key]

    def put(self, key: str, figures: dict[str, Any]) -> None:
        self._mem[key] = figures
        if self.folder is None:
            return
        os.makedirs(self.folder, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.folder, suffix=".tmp", delete=False) as f:  # whole or absent
            json.dump(figures, f)
        os.replace(f.name, os.path.join(self.folder, f"{key}.json"))


def _figures(compiled) -> dict[str, Any]:
    """XLA's memory figures and FLOPs per chip of a compiled program. `flops` and `bytes_accessed`
    are cost_analysis()'s, which counts a loop's body once (the decode loop's token step, the
    layers' scan); `loop_*` count each loop as often as it runs (grpo_core.rl.hlo_cost), but for
    the loops whose trip count the data decides (decode's phases): `iterations` holds one
    iteration of each, in program order, `iteration_*` the dearest (None: the program has none)."""
    ma = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    loops = hlo_cost.analyse(compiled.as_text())
    it = loops.per_iteration
    args, outs, alias, temp = (
        ma.argument_size_in_bytes,
        ma.output_size_in_bytes,
        ma.alias_size_in_bytes,
        ma.temp_size_in_bytes,
    )
    # XLA:TPU allocates a program's temporaries as one block beside its arguments and outputs; its
    # heap-simulated peak_memory_in_bytes can be lower than that block (9.24 vs 10.06 GiB for
    # qwen2.5-0.5b's update on v5e): the larger is what the chip must hold
    peak = max(int(getattr(ma, "peak_memory_in_bytes", 0) or 0), int(args + outs - alias + temp))
    return dict(
        compiled=True,
        argument_bytes=int(args),
        output_bytes=int(outs),
        alias_bytes=int(alias),
        temp_bytes=int(temp),
        code_bytes=int(ma.generated_code_size_in_bytes),
        xla_peak_bytes=peak,
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        loop_flops=loops.once.flops,
        loop_bytes=loops.once.bytes,
        collective_bytes=loops.once.collective_bytes,
        iteration_flops=None if it is None else it.flops,
        iteration_bytes=None if it is None else it.bytes,
        iteration_collective_bytes=None if it is None else it.collective_bytes,
        iterations=[dict(flops=c.flops, bytes=c.bytes, collective_bytes=c.collective_bytes) for c in loops.iterations],
    )


def _refusal(exc: Exception) -> dict[str, Any]:
    """XLA's refusal of a program that does not fit, as figures; anything else is re-raised."""
    found = _oom_bytes(str(exc))
    if found is None and "RESOURCE_EXHAUSTED" not in str(exc):
        raise exc
    return dict(
        compiled=False,
        xla_capacity_bytes=found[1] if found else None,
        xla_peak_bytes=found[0] if found else None,
        error=str(exc).strip().splitlines()[0][:400],
    )


def analyse(
    name: str,
    compile_: Callable[[], Any],
    resident: int,
    hbm: int,
    cache: ProgramCache | None = None,
) -> dict[str, Any]:
    """Compile one program; XLA's memory figures and FLOPs per chip, or its refusal. `compile_`
    returns the program lowered (jax.stages.Lowered) or compiled; lowered, its figures may come
    from `cache` (`compile_s` 0, `cached` true). A `compile_.cache_key()` attribute, when set,
    names the program instead of its lowered text, without lowering it (decode, whose input
    layouts are prefill's compiled outputs)."""
    t = time.perf_counter()
    keyer = getattr(compile_, "cache_key", None)
    key = cache.key(keyer()) if cache is not None and keyer is not None else None
    staged = lowered = None
    if key is None or cache.get(key) is None:
        staged = compile_()
        lowered = staged if hasattr(staged, "compile") else None
        if key is None and cache is not None and lowered is not None:
            key = cache.key(lowered.as_text())
    lower_s = time.perf_counter() - t
    with cache.lock(key) if key is not None else contextlib.nullcontext():
        figures = cache.get(key) if key is not None else None
        cached = figures is not None
        if figures is None:
            if staged is None:  # named by cache_key, not lowered yet, and no longer cached: lower it now
                staged = compile_()
                lowered = staged if hasattr(staged, "compile") else None
            t1 = time.perf_counter()
            try:
                figures = _figures(lowered.compile() if lowered is not None else staged)
            except Exception as exc:  # noqa: BLE001 - XLA's refusal is the answer; anything else is re-raised
                figures = _refusal(exc)
            figures["xla_compile_s"] = round(time.perf_counter() - t1, 2)
            if key is not None:
                cache.put(key, figures)
    used = figures["xla_peak_bytes"]
    out: dict[str, Any] = {"program": name, "resident_bytes": resident, **figures}
    out.update(
        cached=cached,
        lower_s=round(lower_s, 2),
        compile_s=0.0 if cached else round(time.perf_counter() - t, 2),
        peak_bytes=None if used is None else used + resident,
        fits=figures["compiled"] and used + resident <= HEADROOM * hbm,
    )
    return out


class _CompileOnce:
    """A lowered program whose compile() runs once, whoever asks first (analyse, for its figures,
    or decode, for prefill's output layouts)."""

    def __init__(self, lowered):
        self.lowered, self._compiled, self._lock = lowered, None, threading.Lock()

    def as_text(self) -> str:
        return self.lowered.as_text()

    def compile(self):
        with self._lock:
            if self._compiled is None:
                self._compiled = self.lowered.compile()
            return self._compiled


@dataclasses.dataclass
class EvalShape:
    """What evaluation's generate runs: prompts per batch, samples per prompt, their temperature."""

    batch_size: int = 64
    num_samples: int = 4
    temperature: float = 1.0


class RunPrograms:
    """The abstract state of one run on `devices` and the lowering of each of its programs."""

    def __init__(
        self,
        model: ModelConfig,
        train: TrainConfig,
        max_prompt_tokens: int,
        devices: list,
        evaluation: EvalShape | None = None,
        lora=None,
        separate_reference: bool = False,
        reward_models: tuple[memory.RewardModelShape, ...] = (),
    ):
        self.mc, self.train, self.devices = model, train, devices
        self.max_prompt_tokens, self.lora, self.separate_reference = max_prompt_tokens, lora, separate_reference
        self.eval = evaluation or EvalShape()
        self.shapes = memory.Shapes.of(train, max_prompt_tokens)
        self.placement = pl = Placement.from_config(train.mesh, devices)

        def build():
            m = create_model(model, 0)
            if lora is not None:
                lora_mod.apply(m, lora, 0)
            return m

        abstract = nnx.eval_shape(build)
        self.frozen = self.ref_graphdef = None
        if lora is not None:
            self.graphdef, self.ref_graphdef, frozen, params = lora_mod.split(abstract)
            self.frozen = _laid(frozen, pl.param_shardings(frozen))
        else:
            self.graphdef, params = nnx.split(abstract)
        self.params = _laid(params, pl.param_shardings(params))
        self.full_graphdef = nnx.graphdef(abstract)  # the policy as the sampler runs it
        g = train.grpo
        self.ref_params = self.ref_copy = None
        if g.needs_reference:  # under LoRA the base is the reference, unless it is weights of its own
            if lora is not None and not separate_reference:
                self.ref_params = self.frozen
            else:  # a copy of the weights, matrices in the compute dtype, on the reference mesh
                bf16 = model.dtype is DType.BFLOAT16
                cast = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(
                        x.shape, jnp.bfloat16 if bf16 and x.ndim >= 2 and x.dtype == jnp.float32 else x.dtype
                    ),
                    params if lora is None else frozen,
                )
                self.ref_copy = self.ref_params = _laid(cast, pl.param_shardings(cast, pl.reference))
        # reward models (rewards[].model): their weights on the reference's mesh, as the worker loads them
        self.reward_models = []
        for rm in reward_models:
            rg, rp = nnx.split(nnx.eval_shape(lambda c=rm.config: SequenceClassifier(c, rngs=nnx.Rngs(0))))
            self.reward_models.append((rm, rg, _laid(rp, pl.param_shardings(rp, pl.reference))))
        # old_logp rescored by the learner: in a program of its own, or inside the update (as GRPOTrainer does)
        self.rescore = train.rollout.learner_logprobs(model.dtype) and not train.rescores_in_update(model.dtype)
        self.is_mode = train.rollout.is_mode(model.dtype) if self.rescore else ISCorrection.OFF

    # -- arrays ---------------------------------------------------------------------------------

    def _batch(self, prompts: int, mesh=None) -> Batch:
        s, g = self.shapes, self.train.grpo
        b, n = prompts * g.num_generations, s.new_tokens

        def a(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self.placement.batch_sharding(shape, mesh))

        return Batch(
            prompt_tokens=a((prompts, s.prompt_len), jnp.int32),
            prompt_valid=a((prompts, s.prompt_len), jnp.bool_),
            targets=a((b, n), jnp.int32),
            mask=a((b, n), jnp.float32),
            advantages=a((b,), jnp.float32),
            old_logp=a((b, n), jnp.float32),
            ref_logp=a((b, n), jnp.float32),
            rollout_weight=a((b, n), jnp.float32) if self.is_mode is not ISCorrection.OFF else None,
        )

    def learner(self, remat: RematPolicy, accum: int) -> tuple[Learner, TrainState]:
        """The learner with these choices and its abstract state (the optimizer's moments laid
        out like their parameters, as Placement.init_opt_state makes them)."""
        pl, g = self.placement, self.train.grpo
        train = self.train.replace(remat=remat, grpo=g.replace(grad_accum_steps=accum))
        hp = LossParams.from_train(train, self.mc.dtype)
        total = train.num_steps * g.num_iterations * g.minibatches_per_rollout
        lr = Learner(self.graphdef, train.optimizer, hp, total, self.ref_graphdef, pl)
        opt = jax.eval_shape(lr.tx.init, self.params)
        state = TrainState(
            params=self.params,
            opt_state=_laid(opt, pl.param_shardings(opt)),
            step=jax.ShapeDtypeStruct((), jnp.int32, sharding=pl.replicated()),
        )
        lr.state_sharding = jax.tree.map(lambda x: x.sharding, state)
        return lr, state

    def resident(self) -> dict[str, int]:
        """Bytes per chip of the run's long-lived arrays."""
        lr, state = self.learner(RematPolicy.FULL, 1)
        pl = self.placement
        each = {f"reward_model_{i}": chip_bytes(p) for i, (_, _, p) in enumerate(self.reward_models)}
        return {
            "params": chip_bytes(self.params),
            "optimizer": chip_bytes(state["opt_state"]),
            "frozen": chip_bytes(self.frozen) if self.frozen is not None else 0,
            "reference": chip_bytes(self.ref_copy) if self.ref_copy is not None else 0,
            "rollout_copy": 0 if pl.rollout is pl.train else chip_bytes(self._rollout_params()),
            "reward_models": sum(each.values()),  # resident through every program (0 without one)
            **each,
        }

    def _rollout_params(self):
        pl = self.placement
        whole = self.params if self.frozen is None else nnx.merge_state(self.frozen, self.params)
        if pl.rollout is pl.train:
            return whole
        return _laid(whole, pl.param_shardings(whole, pl.rollout))

    # -- programs: name -> (compile, the resident terms that are not its arguments) ----------

    def update(self, remat: RematPolicy, accum: int):
        lr, state = self.learner(remat, accum)
        g = self.train.grpo
        batch = self._batch(g.prompts_per_step // g.minibatches_per_rollout)
        return (lambda: lr.update.lower(state, batch, self.frozen)), ("reference", "rollout_copy", "reward_models")

    def programs(self) -> dict[str, tuple[Callable[[], Any], tuple[str, ...]]]:
        """Every program but the update (which depends on remat and accumulation)."""
        g, pl = self.train.grpo, self.placement
        out: dict[str, tuple[Callable[[], Any], tuple[str, ...]]] = {}
        lr, _ = self.learner(RematPolicy.NONE, 1)
        if self.ref_params is not None:
            ref_mesh = None if pl.reference is pl.train else pl.reference
            batch = self._batch(g.prompts_per_step, ref_mesh)
            out["reference"] = (
                lambda: lr._score.lower(self.ref_params, batch),
                ("params", "optimizer", "rollout_copy", "reward_models")
                + (("frozen",) if self.ref_copy is not None else ()),
            )
        if self.rescore:
            policy = self.params if self.frozen is None else nnx.merge_state(self.frozen, self.params)
            rows = self._batch(g.prompts_per_step)
            out["old_logprobs"] = (
                lambda: lr.score_policy.lower(policy, rows),
                ("optimizer", "reference", "rollout_copy", "reward_models"),
            )
        opts = self.sampler_options()
        prefill, decode = self._generate(
            self._rollout_params(), g.prompts_per_step, g.num_generations, opts, pl.rollout, batch_mesh=pl.rollout
        )
        others = ("optimizer", "reference", "reward_models") + (
            ("params", "frozen") if pl.rollout is not pl.train else ()
        )
        out["prefill"], out["decode"] = (prefill, others), (decode, others)
        e = self.eval
        samples = max(1, e.num_samples)
        eopts = dataclasses.replace(opts, temperature=0.0 if samples == 1 else e.temperature)
        if pl.rollout.size > 1:  # the evaluation worker generates over the rollout's mesh, as the rollout does
            eprefill, edecode = self._generate(
                self._rollout_params(), e.batch_size, samples, eopts, pl.rollout, batch_mesh=pl.rollout
            )
        else:
            one = SingleDeviceSharding(self.devices[0])
            whole = self.params if self.frozen is None else nnx.merge_state(self.frozen, self.params)
            eparams = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), whole)
            eprefill, edecode = self._generate(eparams, e.batch_size, samples, eopts, None, single=one)
        out["eval_prefill"], out["eval_decode"] = (eprefill, ("reward_models",)), (edecode, ("reward_models",))
        policy = ("params", "optimizer", "frozen", "reference", "rollout_copy")
        for i, (rm, rg, rp) in enumerate(self.reward_models):  # after the rollout, beside the policy's state
            others = tuple(f"reward_model_{j}" for j in range(len(self.reward_models)) if j != i)
            name = "reward_model" if i == 0 else f"reward_model_{i}"
            out[name] = (
                lambda rm=rm, rg=rg, rp=rp: score_lowered(rg, rp, rm.batch_size, rm.max_length, pl),
                policy + others,
            )
        return out

    def sampler_options(self) -> sampler.SamplerOptions:
        """The rollout's sampler options, with the target chip's backend defaults, not this host's
        (evaluation's differ in temperature only)."""
        target = sampler.backend_defaults(self.devices[0].platform)
        return sampler.SamplerOptions.from_config(self.train.sampling, (0,), 0, **target)

    def _generate(self, params, prompts: int, samples: int, opts, mesh, batch_mesh=None, single=None):
        """Lowerings of prefill and decode, decode taking prefill's outputs in the layouts its
        compiled program gives them (as grpo_core.rl.sampler.compile_jobs does). Decode is named in
        a ProgramCache by prefill's module and its own options: those fix its lowering, so a
        cached decode needs no prefill compiled."""
        tp = self.shapes.prompt_len
        if single is not None:
            lay = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=single)
            key_sharding = single
        else:
            lay = lambda shape, dt: jax.ShapeDtypeStruct(
                shape, dt, sharding=self.placement.batch_sharding(shape, batch_mesh)
            )
            key_sharding = self.placement.replicated(batch_mesh)
        ptok, pval = lay((prompts, tp), jnp.int32), lay((prompts, tp), jnp.bool_)
        key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=key_sharding)
        kw = dict(opts=opts, num_samples=samples, mesh=mesh)
        graph, done, lock = self.full_graphdef, {}, threading.Lock()

        def lower_prefill():
            with lock:
                if "prefill" not in done:
                    done["prefill"] = _CompileOnce(sampler.prefill.lower(graph, params, ptok, pval, key, **kw))
            return done["prefill"]

        def lower_decode():
            cache, state = jax.eval_shape(
                lambda p, t, v, k: sampler.prefill(graph, p, t, v, k, **kw), params, ptok, pval, key
            )
            shardings = lower_prefill().compile().output_shardings  # analyse's compile of prefill, if it ran
            return sampler.decode.lower(
                graph, params, _laid(cache, shardings[0]), _laid(state, shardings[1]), key, opts=opts, prompt_len=tp
            )

        def decode_key() -> str:
            return f"decode {opts!r} {tp}\n{lower_prefill().as_text()}"

        lower_decode.cache_key = decode_key  # type: ignore[attr-defined]
        return lower_prefill, lower_decode


# -- the check: every program for the target, remat and accumulation chosen with the compiler ------


def check(
    model: ModelConfig,
    train: TrainConfig,
    max_prompt_tokens: int,
    target: Target,
    evaluation: EvalShape | None = None,
    lora=None,
    separate_reference: bool = False,
    max_extra: int = 4,
    only: tuple[str, ...] | None = None,
    cache: ProgramCache | None = None,
    threads: int = 2,
    reward_models: tuple[memory.RewardModelShape, ...] = (),
) -> dict[str, Any]:
    """Compile the run's programs for `target`; the report (see grpo_core.stages.aot). train.remat
    and train.grpo.grad_accum_steps at auto are chosen here: candidates cheapest first, the first
    whose update XLA fits. A fixed choice that does not fit is kept (and reported as not fitting),
    with up to `max_extra` other candidates compiled to name one that would. `only`: the programs
    besides the update to compile (default: all of them). `cache`: XLA's figures per program
    (default: this call's only, which still compiles a program met twice once). `threads`: the
    programs other than the update compiled at once (XLA releases the GIL while it compiles),
    beside the update's candidates, which run one after another in the calling thread."""
    t0 = time.perf_counter()
    devices = topology_devices(target)
    t_topo = time.perf_counter() - t0
    run = RunPrograms(model, train, max_prompt_tokens, devices, evaluation, lora, separate_reference, reward_models)
    hbm, resident = target.hbm_bytes, run.resident()
    cache = cache or ProgramCache()
    try_update, hopeless = _update_trial(run, hbm, cache, resident)
    auto = train.remat is RematPolicy.AUTO or train.grpo.grad_accum_steps == "auto"
    cands = memory.candidates(train, backend="tpu")
    tried, fix = [], None
    pool = concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="aot")
    programs = run.programs()
    others = {
        name: pool.submit(analyse, name, compile_, sum(resident[k] for k in extra), hbm, cache)
        for name, (compile_, extra) in programs.items()
        if only is None or name in only
    }
    try:
        update, fix = _choose_update(train, cands, hopeless, try_update, tried, max_extra)
        results = [update] + [f.result() for f in others.values()]
    finally:
        pool.shutdown(cancel_futures=True)
    worst = max(results, key=lambda r: r["peak_bytes"] or math.inf)
    estimate = _estimate(run, results, target, ("update", *programs))
    if train.rollout.layout is RolloutLayout.SPLIT:  # the same step with the chips split between the sides
        estimate["split"] = _split(run, devices, target, estimate, cache)
    fits = all(r["fits"] for r in results)
    return {
        "target": target.to_dict(),
        "mesh": run.placement.describe(),
        "devices": len(devices),
        "remat": update["remat"],
        "grad_accum_steps": update["grad_accum_steps"],
        "auto": auto,
        "programs": results,
        "update_candidates": [
            {
                k: r.get(k)
                for k in (
                    "remat",
                    "grad_accum_steps",
                    "fits",
                    "xla_peak_bytes",
                    "peak_bytes",
                    "formula_bytes",
                    "compile_s",
                    "cached",
                )
            }
            for r in tried
        ],
        "resident_bytes": resident,
        "memory": {
            "source": "xla",
            "peak_bytes": worst["peak_bytes"],
            "peak_program": worst["program"],
            "hbm_bytes": hbm,
            "usable_bytes": int(HEADROOM * hbm),
            "fits": fits,
            "formula_bytes": update["formula_bytes"],
        },
        "flops_per_step": estimate["flops_per_step"],  # loops counted, full-length completions
        "estimate": estimate,
        "fix": None if fits else _fix(results, fix, train, evaluation or EvalShape()),
        "topology_s": round(t_topo, 2),
        "threads": threads,
        "programs_cached": sum(bool(r["cached"]) for r in tried) + sum(bool(r["cached"]) for r in results[1:]),
        "compile_s": round(sum(r["compile_s"] for r in tried) + sum(r["compile_s"] for r in results[1:]), 2),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _estimate(run: RunPrograms, results: list[dict[str, Any]], target: Target, names) -> dict[str, Any]:
    """A step's roofline bound (grpo_core.config.roofline) from its programs' figures: `names` the
    programs the run has."""
    g, s = run.train.grpo, run.shapes
    whole = run.params if run.frozen is None else nnx.merge_state(run.frozen, run.params)
    rollout = chip_bytes(run._rollout_params())
    return roofline.step(
        results,
        target.peaks(),
        runs=tuple(n for n in roofline.STEP_PROGRAMS if n in names),
        updates=g.num_iterations * g.minibatches_per_rollout,
        rollout_tokens=g.prompts_per_step * g.num_generations * s.new_tokens,
        decode_runs=sampler.phase_steps(run.sampler_options()),  # N-token completions
        # evaluation generates over the rollout's mesh, or on one chip holding all the weights
        weight_bytes={
            "rollout": rollout,
            "eval": rollout
            if run.placement.rollout.size > 1
            else sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(whole)),
        },
    )


def _update_trial(run: RunPrograms, hbm: int, cache, resident: dict[str, int]):
    """(try_update, hopeless) for `run`'s chips: try_update(remat, accum) compiles that update and
    reports it; hopeless(candidate) says the formula puts it past FORMULA_SKIP x the usable HBM
    (the formula chooses nothing; it only skips what XLA would refuse anyway)."""
    trainable = None if run.lora is None else lora_mod.num_adapter_params(run.mc, run.lora)
    formula = memory.update_bytes(
        run.mc,
        run.train,
        run.max_prompt_tokens,
        trainable=trainable,
        layout=memory.Layout(*run.train.mesh.sizes(len(run.devices))),
        backend="tpu",
        separate_reference=run.separate_reference,
    )

    def try_update(remat, accum) -> dict[str, Any]:
        compile_, extra = run.update(remat, accum)
        r = analyse("update", compile_, sum(resident[k] for k in extra), hbm, cache)
        r.update(remat=remat.value, grad_accum_steps=accum, formula_bytes=formula(remat, accum))
        return r

    return try_update, lambda c: formula(*c) > FORMULA_SKIP * HEADROOM * hbm


def _split(run: RunPrograms, devices: list, target: Target, colocated: dict[str, Any], cache) -> dict:
    """The step with the chips split (train.rollout.layout=split): the learner's programs (the
    update, its remat and accumulation chosen for its chips as `check` chooses them, the
    reference) compiled for the first chips, the rollout's (prefill, decode; with max_staleness >= 1 also the drawing
    policy's log-probs where the learner would rescore them: the rollout side holds that version)
    for the others (train.rollout.devices of them), each side on a mesh of its own chips. Its
    `programs` say whether each fits there."""
    train, k = run.train, run.train.max_staleness
    learner_n, rollout_n = train.rollout.split_counts(len(devices), f"chips of {target.name}")
    sides = {}
    for name, chips in (("learner", devices[:learner_n]), ("rollout", devices[learner_n:])):
        try:
            part = RunPrograms(run.mc, train, run.max_prompt_tokens, chips, None, run.lora, run.separate_reference)
        except ConfigError:  # train.mesh names sizes for every chip: the default mesh over this side's
            part = RunPrograms(
                run.mc, train.replace(mesh=MeshConfig()), run.max_prompt_tokens, chips, None, run.lora,
                run.separate_reference,
            )  # fmt: skip
        resident = dict(part.resident(), rollout_copy=0)  # the rollout's weights are on its own chips
        programs = part.programs()
        results = []
        if name == "learner":  # remat and accumulation chosen again for these chips, as check chooses them
            try_update, hopeless = _update_trial(part, target.hbm_bytes, cache, resident)
            cands = memory.candidates(part.train, backend="tpu")
            results.append(_choose_update(part.train, cands, hopeless, try_update, [], max_extra=0)[0])
            wanted = ("reference",) + (("old_logprobs",) if k == 0 else ())
        else:  # its chips hold its weights (arguments) and nothing of the learner's
            wanted = ("prefill", "decode") + (("old_logprobs",) if k > 0 else ())
            resident = dict.fromkeys(resident, 0)
        for program in (p for p in wanted if p in programs):
            compile_, extra = programs[program]
            results.append(analyse(program, compile_, sum(resident[r] for r in extra), target.hbm_bytes, cache))
        names = tuple(r["program"] for r in results)
        sides[name] = (_estimate(part, results, target, names), results)
    whole = run.params if run.frozen is None else nnx.merge_state(run.frozen, run.params)
    out = roofline.split_step(
        colocated,
        sides["learner"][0],
        sides["rollout"][0],
        max_staleness=k,
        learner_chips=learner_n,
        rollout_chips=rollout_n,
        weight_bytes=sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(whole)),
    )
    out["fits"] = all(r["fits"] for _, results in sides.values() for r in results)
    keep = ("program", "peak_bytes", "fits", "compile_s", "cached", "remat", "grad_accum_steps")
    out["memory"] = {side: [{f: r[f] for f in keep if f in r} for r in rs] for side, (_, rs) in sides.items()}
    return out


def _choose_update(train: TrainConfig, cands, hopeless, try_update, tried: list, max_extra: int):
    """The update's report (candidates cheapest first, the first XLA fits; else the one that needs
    least) and, when none fits, a setting that would (up to `max_extra` others compiled). Appends
    every candidate compiled to `tried`."""
    fix = None
    for c in [c for c in cands if not hopeless(c)] or cands[-1:]:
        tried.append(try_update(*c))
        if tried[-1]["fits"]:
            return tried[-1], fix
    update = min(tried, key=lambda r: r["peak_bytes"] or math.inf)
    g = train.grpo
    wider = train.replace(
        remat=RematPolicy.AUTO,
        grpo=g.replace(grad_accum_steps="auto", minibatches_per_rollout=g.minibatches_per_rollout),
    )
    seen = {(r["remat"], r["grad_accum_steps"]) for r in tried}
    others = [c for c in memory.candidates(wider, backend="tpu") if (c[0].value, c[1]) not in seen]
    for c in [c for c in others if not hopeless(c)][:max_extra]:
        tried.append(try_update(*c))
        if tried[-1]["fits"]:
            fix = f"set train.remat={c[0].value} and train.grpo.grad_accum_steps={c[1]}"
            break
    return update, fix


def _fix(results, update_fix: str | None, train: TrainConfig, evaluation: EvalShape) -> str:
    """What to change, for the first program that does not fit."""
    bad = next(r for r in results if not r["fits"])
    g, s = train.grpo, train.sampling
    name = bad["program"]
    if name == "update":
        return update_fix or (
            "no remat/accumulation setting fits: use LoRA (model.lora), bfloat16 parameters, "
            "train.optimizer.mu_dtype=bfloat16, more chips (a larger topology) or lower train.sampling.max_new_tokens"
        )
    if name.startswith("eval_"):
        return f"lower eval.batch_size (now {evaluation.batch_size}) or eval.num_samples (now {evaluation.num_samples})"
    if name.startswith("reward_model"):
        return "lower rewards[].batch_size or rewards[].max_length of the reward model, or split it over more chips"
    if name in ("prefill", "decode"):
        return (
            f"lower train.grpo.prompts_per_step (now {g.prompts_per_step}) or train.sampling.max_new_tokens "
            f"(now {s.max_new_tokens}), or split the weights over more chips (train.mesh)"
        )
    return f"lower train.grpo.prompts_per_step (now {g.prompts_per_step}) or set train.logits_chunk_mib lower"
