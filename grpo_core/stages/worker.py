"""The worker: the process a pipeline task launches and watches for each stage that touches an
accelerator (DESIGN.md says why these never run inside the Prefect process).

    python -m grpo_core.stages.worker train --root RUN_URL --until-step N [--then-eval 0,N] [--then-export]
    python -m grpo_core.stages.worker eval  --root RUN_URL --steps 0,100,200
    python -m grpo_core.stages.worker export --root RUN_URL [--step N]

The config is the run's `config.json` (written by the pipeline before any stage runs), or
`--config FILE`. `train` restores the newest finalised checkpoint under `checkpoints/` (only
one written for the same training hash), trains until N steps are done in total, and every
`pipeline.checkpoint_every` steps writes the metrics shard of those steps and then a checkpoint
(outputs first, checkpoint last). `eval` evaluates the starting policy (step 0) or a
checkpoint and writes `eval/{step}.json`, skipping steps already evaluated with the same config.
`train --then-eval STEPS --then-export` goes on, once trained ("done"), to what `eval` and
`export` do, in the same process (the pipeline's stages then pay one JAX start, restore and
compile per epoch, not three); on a TPU (GRPO_EVAL_AHEAD) a thread compiles the evaluation's
programs while it trains.
Progress goes to stdout as JSON lines, one object per event:

    {"event": "start" | "resumed", "step": s, "until": N}
    {"event": "rollout_side", "layout": ..., "max_staleness": k, ...}  # k >= 1 or split: where the rollout runs
    {"event": "step", "step": s, "reward": ..., ...}          # after each step (async/*: its batch's version, waits)
    {"event": "checkpoint", "step": s, "uri": ...}            # durable: safe to be killed now
    {"event": "done", "step": N, "steps_run": n}
    {"event": "eval", "step": s, "uri": ..., "cached": bool, "accuracy": ..., ...}
    {"event": "export", "step": s, "uri": ..., "cached": bool, "files": [...]}
    {"event": "memory", "describe": ..., "total_bytes": ..., ...}  # grpo_core.config.memory's plan, before training
    {"event": "error", "kind": "config" | "data" | "reward" | "diverged" | "storage" | "rollout" | "distributed"
     | "memory", "message": ...}

Exit codes (grpo_core.errors.ExitCode; grpo_core.errors.FAILURES says which exception gives which):
0 done; 2 config or data error, 3 reward-function error, 6 diverged (NaN/Inf), 9 out of memory —
none worth retrying, a retry would fail the same way; anything else (a crash, a kill, 5 for a
storage error, 7 for a rollout engine that failed or passed a time limit, 8 for a multi-host
setup that failed: a process did not join in time, or the processes disagree) is worth retrying:
the next run resumes from the last checkpoint, re-running at most checkpoint_every - 1 steps,
whose metric rows then replace their earlier copies (storage.RunRoot.read_metrics keeps one
row per step).

Multi-host (grpo_core.launch.cluster): `--distributed`, or GRPO_COORDINATOR / GRPO_NUM_PROCESSES /
GRPO_PROCESS_ID set by a launcher (grpo_core.launch.launchers), joins jax.distributed before anything
else. Every process runs the same stage; process 0 alone prints events and writes metrics,
evaluation results and exports (checkpoints are written by all, as Orbax requires); training
starts only once every process agrees on the config hash and the first batch.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import functools
import gc
import importlib.util
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from grpo_core.errors import (
    OUT_OF_MEMORY,
    OUT_OF_MEMORY_LEVERS,
    ConfigError,
    ExitCode,
    RewardFunctionError,
    RewardTimeout,
    RolloutTimeout,
    StorageError,
    classify,
)
from grpo_core.launch.processes import ENV_WATCH_PARENT, imports_without_gc
from grpo_core.store.lease import process_alive

# What a stage needs (JAX, the run's storage and config, numpy) is imported in the function that
# needs it, marked `# worker start`: this module imports in ~0.1 s, so `--help` and a bad argument
# answer at once, and main() installs the stop handlers before the seconds those imports take.

_STEP_KEYS = (
    "reward",
    "reward_std",
    "frac_rows_scored",
    "kl",
    "entropy",
    "grad_norm",
    "learning_rate",
    "completions/mean_length",
    "time/step",
)


_PRIMARY = True  # process 0 of a multi-host run (or the only process): the one that reports and writes

# A stop request: SIGTERM (a stage's time limit, `grpo run` interrupted with Ctrl-C, a scheduler),
# SIGINT, or the launching process gone (ENV_WATCH_PARENT). Training stops at the next
# step boundary and saves a checkpoint there; whatever is still running STOP_GRACE_S later (a long
# step, a compilation, an evaluation) ends then without one: the run resumes from its last
# checkpoint either way. The grace is shorter than the launcher's SIGTERM-to-SIGKILL grace (10 s)
# so that the worker exits with its own code and message.
ENV_STOP_GRACE = "GRPO_STOP_GRACE_S"
_STOP = threading.Event()
_STOP_WHY: list[str] = []


def _request_stop(why: str) -> None:
    if _STOP.is_set():
        return
    _STOP_WHY.append(why)
    _STOP.set()
    grace = float(os.environ.get(ENV_STOP_GRACE, "8"))
    threading.Thread(target=_stop_after, args=(grace, why), daemon=True, name="stop-grace").start()


def _stop_after(grace_s: float, why: str) -> None:
    time.sleep(grace_s)
    _emit("interrupted", step=None, message=f"stopped ({why}) {grace_s:g} s later, between checkpoints")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(ExitCode.INTERRUPTED)


def _install_stop_handlers() -> None:
    """Once per process (a process that stays runs main once per stage: grpo_core.stages.ahead)."""
    if _HANDLERS:
        return
    _HANDLERS.append(True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: _request_stop(f"{signal.Signals(signum).name} received"))
    if os.environ.get(ENV_WATCH_PARENT) == "1":
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()


_HANDLERS: list[bool] = []
_PRELOADED: list[bool] = []


def stop_requested() -> bool:
    """Whether this process was asked to stop (a signal, or its launcher gone)."""
    return _STOP.is_set()


def _watch_parent(parent: int) -> None:
    """A process whose parent exits is re-parented (to init or a subreaper): poll for that."""
    while os.getppid() == parent:
        time.sleep(1.0)
    _request_stop("the process that launched it is gone")


def _emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout, from process 0 only (the launcher streams process 0's); another
    process's error goes to its stderr, which the launcher keeps for the failure message."""
    line = json.dumps({"event": event, **fields})
    try:
        if _PRIMARY:
            print(line, flush=True)
        elif event == "error":
            print(line, file=sys.stderr, flush=True)
    except OSError:  # BrokenPipeError: the launcher that read it is gone (a kill -9 of `grpo run`)
        _output_gone()


def _output_gone() -> None:
    """The launcher reading this process's output is gone: stop as its death would stop it (at the
    next step boundary, a checkpoint saved), writing what follows nowhere. Before, the next line's
    BrokenPipeError ended the worker at once without one, and up to checkpoint_every steps were lost."""
    devnull = open(os.devnull, "w")  # noqa: SIM115 - this process's stdout and stderr from now on
    sys.stdout = sys.stderr = devnull
    _request_stop("the process that read its output is gone")


def train(parts, until_step: int, then_eval: list[int] | None = None, config_file: str | None = None) -> int:
    from grpo_core.config import memory  # worker start: config
    from grpo_core.data.prepare import DatasetPrompts  # worker start: fsspec
    from grpo_core.rewards import reward_model  # worker start: fsspec
    from grpo_core.rl.checkpoint import Checkpointer  # worker start: JAX
    from grpo_core.rl.trainer import GRPOTrainer  # worker start: JAX
    from grpo_core.runtime.mesh import Placement  # worker start: JAX

    cfg, root = parts.cfg, parts.root
    if until_step > cfg.train.num_steps:  # the LR schedule spans train.num_steps: never stretch it
        raise ConfigError(f"--until-step {until_step} is past train.num_steps ({cfg.train.num_steps})")
    every, h = cfg.pipeline.checkpoint_every, cfg.train_hash
    train_cfg = cfg.train
    chosen = _compiler_choice(parts)
    if chosen is not None:  # the readiness stage's compiler chose remat and accumulation for these very chips
        remat, accum = chosen
        train_cfg = train_cfg.replace(remat=remat, grpo=train_cfg.grpo.replace(grad_accum_steps=accum))
    train_cfg = _local_choice(parts, train_cfg)
    dtype = cfg.compute_dtype.value  # a reward model's, as the run's
    plan = memory.plan_on(
        parts.model_config(),
        train_cfg,
        cfg.data.max_prompt_tokens,
        memory.device_facts(),  # before the model exists: the runtime term is this process alone
        cfg.model.lora,
        separate_reference=cfg.separate_reference,
        reward_models=reward_model.shapes(parts.rewards, dtype),
    )
    _emit("memory", describe=plan.describe(), **plan.report())
    placement = Placement.from_config(cfg.train.mesh)  # checkpoint weights load straight onto it
    reward_model.open_all(parts.rewards, placement, dtype)  # onto the reference's mesh, as the reference
    if _PRIMARY:  # the run's own copy of model.init_from's policy: it outlives the other run's files
        kept = parts.keep_start()
        if kept is not None:
            _emit("start_copied", **kept)
    ends = [cfg.epoch_end(e) for e in range(cfg.pipeline.epochs)] if cfg.pipeline.keep_epoch_checkpoints else []
    # The run's one writer deletes the unfinished saves a killed worker left (4.orbax-checkpoint-tmp);
    # closing(trainer) stops its rollout engine.
    with contextlib.ExitStack() as stack:
        ckpt = stack.enter_context(Checkpointer(root.uri("checkpoints"), keep_steps=ends, cleanup_tmp=True))
        # Resuming, the policy is built as shapes for the checkpoint to fill: never initialised, or
        # read from model.path, only to be overwritten (parts.policy_shapes says where it can be).
        needs_reference = cfg.train.grpo.needs_reference
        shapes = parts.policy_shapes() if ckpt.all_steps() and not needs_reference else None
        trainer = GRPOTrainer(
            parts.create_policy(placement) if shapes is None else shapes,
            train_cfg,
            parts.tokenizer,
            parts.rewards,
            DatasetPrompts(parts.train_rows, seed=cfg.data.seed),
            placement=placement,
            memory_plan=plan,
            reference=parts.reference_policy(placement) if needs_reference else None,
            # train.rollout.layout=split: the rollout process reads this same run (grpo_core.stages.rollout)
            rollout_argv=["--root", root.url] + (["--config", config_file] if config_file else []),
        )
        stack.enter_context(contextlib.closing(trainer))
        trainer.until = until_step  # the rollout side draws no batch past what this stage's checkpoints keep
        # A newest checkpoint that fails to restore is set aside (moved, not deleted) and the next
        # older one tried; each one says so: step, uri, moved_to, error, next_step and a message.
        resumed = trainer.restore(
            ckpt, config_hash=h, on_set_aside=lambda aside: _emit("checkpoint_set_aside", **aside.as_event())
        )
        if not resumed and shapes is not None:  # every checkpoint was set aside: step 0 after all
            trainer.start_from(parts.create_policy(placement))
        start = trainer.step
        _agree(h, trainer)
        if then_eval and start < until_step:
            _eval_ahead(parts, trainer)
        _emit("resumed" if resumed else "start", step=start, until=until_step)
        if not trainer.source.inline:  # the rollout side: where it runs and how far it may lag
            _emit("rollout_side", **_rollout_side(trainer))
        pending: list[dict[str, Any]] = []
        flat = 0  # steps in a row on which every group's rewards were all equal
        while trainer.step < until_step:
            m = trainer.train_step()
            pending.append(m)
            flat = flat + 1 if m.get("frac_reward_zero_std", 0.0) >= 1.0 else 0
            no_signal(flat, trainer.step, cfg.pipeline, [r.describe() for r in parts.rewards])
            shown = {k: m[k] for k in ("step", *_STEP_KEYS) if k in m}
            shown.update({k: v for k, v in m.items() if k.startswith("async/")})  # asynchronous rollouts
            _emit("step", **shown, **memory.peak_bytes())
            _test_hook("step", step=trainer.step, root_url=root.url, rollout_pid=_rollout_pid(trainer))
            stop = _STOP.is_set()
            if trainer.step % every == 0 or trainer.step == until_step or stop:
                if _PRIMARY:
                    root.write_metrics(pending)  # outputs first ...
                trainer.save(ckpt, config_hash=h)  # ... the checkpoint (finalised last) after
                ckpt.wait()
                pending = []
                _emit("checkpoint", step=trainer.step, uri=root.uri("checkpoints", str(trainer.step)))
                _test_hook("checkpoint", step=trainer.step, root_url=root.url)
            if stop and trainer.step < until_step:
                why = _STOP_WHY[0] if _STOP_WHY else "stop requested"
                _emit(
                    "interrupted",
                    step=trainer.step,
                    message=f"stopped at step {trainer.step} ({why}), checkpoint saved",
                )
                return ExitCode.INTERRUPTED
    _emit("done", step=trainer.step, steps_run=trainer.step - start)
    return 0


def _rollout_pid(trainer) -> int | None:
    proc = getattr(trainer.source, "proc", None)
    return None if proc is None else proc.pid


def _rollout_side(trainer) -> dict[str, Any]:
    """The rollout_side event: the layout, the staleness bound, and the split process's pid and cores."""
    cfg = trainer.cfg
    out: dict[str, Any] = {"layout": cfg.rollout.layout.value, "max_staleness": cfg.max_staleness}
    proc = getattr(trainer.source, "proc", None)
    if proc is not None:
        out.update(
            pid=proc.pid,
            rollout_cores=trainer.source.rollout_cores,
            learner_cores=trainer.source.learner_cores,
            log=trainer.source.log_path,
        )
    return out


def _compiler_choice(parts):
    """(remat, grad_accum_steps) as XLA chose them for pipeline.readiness.target in this run's
    readiness.json (grpo_core.stages.aot), when this worker runs on that target (same chips, same
    count) and the programs are this config's; else None (the memory plan chooses)."""
    import jax  # worker start: JAX

    from grpo_core.config.train import RematPolicy  # worker start: config
    from grpo_core.launch.requests import programs_key, request_for  # worker start: fsspec

    cfg = parts.cfg
    if not cfg.pipeline.readiness.target or not parts.root.exists("readiness.json"):
        return None
    aot = parts.root.read_json("readiness.json").get("target") or {}
    target, devices = aot.get("target") or {}, jax.devices()
    same_chips = devices[0].device_kind == target.get("device_kind") and len(devices) == target.get("chips")
    if not same_chips or aot.get("programs_key") != programs_key(request_for(cfg, parts.tokenizer.vocab_size)):
        return None
    if not aot["memory"]["fits"]:
        return None
    return RematPolicy(aot["remat"]), int(aot["grad_accum_steps"])


def _local_choice(parts, train_cfg):
    """`train_cfg` with what it leaves at auto (remat, accumulation) chosen by this backend's own
    compiler (grpo_core.rl.compiler_plan: XLA's memory_analysis of each candidate update against
    the device's memory) on an accelerator or with GRPO_DEVICE_MEMORY_BYTES set; else as given
    (the memory plan's formula chooses)."""
    import jax  # worker start: JAX

    from grpo_core.rl import compiler_plan  # worker start: JAX
    from grpo_core.stages.aot import program_cache  # worker start: fsspec

    cfg = parts.cfg
    if train_cfg.memory_resolved or compiler_plan.device_budget() is None:
        return train_cfg
    devices = jax.devices()
    cache = program_cache(backend=devices[0].platform, device_kind=devices[0].device_kind, devices=len(devices))
    from grpo_core.rewards import reward_model  # worker start: fsspec

    choice = compiler_plan.choose(
        parts.model_config(),
        train_cfg,
        cfg.data.max_prompt_tokens,
        cfg.model.lora,
        separate_reference=cfg.separate_reference,
        cache=cache,
        reward_models=reward_model.shapes(parts.rewards, cfg.compute_dtype.value),
    )
    _emit("memory_xla", **choice)
    return compiler_plan.resolve(train_cfg, choice)


def no_signal(flat: int, step: int, pipeline, rewards: list[str]) -> None:
    """After `flat` steps in a row on which every group's rewards were all equal (GRPO's advantages
    all 0: a constant reward, or one this data never varies), a "no_signal" event at each
    pipeline.zero_signal_steps, and RewardFunctionError (exit 3, not retried) at
    pipeline.zero_signal_fail_steps when that is set."""
    if not flat:
        return
    what = (
        f"for {flat} steps in a row (to step {step}) every group's completions got the same reward from "
        f"{', '.join(rewards)}: the advantages are all 0 and the policy learns nothing (a constant reward, one "
        "this data never varies, or a policy that already solves every prompt)"
    )
    fail = pipeline.zero_signal_fail_steps
    if fail and flat >= fail:
        raise RewardFunctionError(f"{what}; stopped by pipeline.zero_signal_fail_steps={fail}")
    if flat % pipeline.zero_signal_steps == 0:
        then = f"; the run fails at {fail}" if fail else "; set pipeline.zero_signal_fail_steps to fail such a run"
        _emit("no_signal", step=step, steps=flat, message=what + then)


def _test_hook(point: str, **info: Any) -> None:
    """Where the tests reach into a running worker: after a step ('step'), once its checkpoint
    is durable ('checkpoint') and before a step's evaluation ('eval'), where tests/faults.py
    kills it to prove that the retry resumes with no step lost or doubled.
    GRPO_TEST_HOOK="path/to/file.py:function" names a function, called as function(point,
    **info); unset, nothing runs. It is named by file path because the worker is a separate
    process whose sys.path need not reach the tests."""
    hook = _load_test_hook(os.environ.get("GRPO_TEST_HOOK", ""))
    if hook is not None:
        hook(point, **info)


@functools.cache
def _load_test_hook(spec: str) -> Callable[..., None] | None:
    if not spec:
        return None
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"GRPO_TEST_HOOK must look like path/to/file.py:function, got {spec!r}")
    found = importlib.util.spec_from_file_location(f"grpo_test_hook_{os.path.basename(path).removesuffix('.py')}", path)
    if found is None or found.loader is None:
        raise ValueError(f"GRPO_TEST_HOOK: cannot load {path!r}")
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return getattr(module, name)


def _agree(config_hash: str, trainer) -> None:
    """With several processes: stop unless every one has the same config hash and draws the same
    first batch (a host that read other data, or another config.json, would feed the shared
    programs other inputs and corrupt them silently)."""
    import jax  # worker start: JAX

    from grpo_core.launch import cluster as distributed  # worker start: numpy

    if jax.process_count() == 1:
        return
    p = trainer.cfg.grpo.prompts_per_step
    differ = distributed.disagreements(
        {"config hash": config_hash, "first batch": distributed.first_batch_digest(trainer.prompts, trainer.step, p)}
    )
    if differ:
        raise distributed.DistributedError(
            "processes disagree before training: "
            + "; ".join(f"{name} of process(es) {procs} differs from process 0's" for name, procs in differ.items())
        )


def evaluate_steps(parts, steps: list[int]) -> int:
    from grpo_core.rewards import reward_model  # worker start: fsspec
    from grpo_core.rewards.functions import TrainerState  # worker start: numpy
    from grpo_core.rl.checkpoint import Checkpointer  # worker start: JAX
    from grpo_core.rl.evaluation import evaluate  # worker start: JAX
    from grpo_core.store.report import read_eval  # worker start: fsspec

    cfg, root, h = parts.cfg, parts.root, parts.cfg.eval_hash
    sampling = _eval_sampling(cfg)
    turns = parts.turns(sampling)  # train.agent: the same episodes as training's
    placement = None  # made at the first step evaluated here: the rollout's mesh, which generates as it does
    _wait_eval_ahead()
    with Checkpointer(root.uri("checkpoints"), max_to_keep=None) as ckpt:
        for step in steps:
            rel = f"eval/{step}.json"
            if root.exists(rel) and root.read_json(rel).get("eval_hash") == h:
                _emit("eval", cached=True, uri=root.uri(rel), **read_eval(root, rel))  # null scores as NaN
                continue
            _test_hook("eval", step=step, root_url=root.url)
            t, compiled_before = time.perf_counter(), len(_COMPILED)
            # prompts done of all passes (greedy, then the sampled one): the task's log and the terminal's bar
            rows, passes = len(parts.eval_rows), 1 + (cfg.eval.num_samples > 1)
            shown = lambda done, p=0: _emit(
                "eval_progress", step=step, done=p * rows + done, total=passes * rows, rows=rows, passes=passes
            )
            shown(0)
            placement = placement or _eval_placement(cfg.train.mesh)
            reward_model.open_all(parts.eval_rewards, placement, cfg.compute_dtype.value)  # once: the same after
            graphdef, params = parts.policy_at(ckpt, step, placement)  # laid out over its rollout mesh
            kw = dict(
                placement=placement,
                turns=turns,
                batch_size=cfg.eval.batch_size,
                seed=cfg.train.seed,
                reward_timeout_s=cfg.train.reward_timeout_s,
                state=TrainerState(global_step=step, max_steps=cfg.train.num_steps),
            )
            greedy = evaluate(
                graphdef, params, parts.tokenizer, parts.eval_rows, parts.eval_rewards, sampling, on_rows=shown, **kw
            )
            result = {"step": step, "eval_hash": h, "accuracy": greedy[cfg.eval.accuracy_reward], "greedy": greedy}
            if cfg.eval.num_samples > 1:
                sampled = evaluate(
                    graphdef,
                    params,
                    parts.tokenizer,
                    parts.eval_rows,
                    parts.eval_rewards,
                    sampling,
                    num_samples=cfg.eval.num_samples,
                    pass_reward=cfg.eval.accuracy_reward,
                    on_rows=lambda done: shown(done, 1),
                    **kw,
                )
                result["sampled"] = sampled
                result.update({k: v for k, v in sampled.items() if k.startswith("pass@")})
            result["examples"] = _examples(parts, graphdef, params, sampling, placement, turns, kw["state"])
            result["devices"] = placement.rollout.size  # generated over them (the rollout's mesh)
            result["seconds"] = round(time.perf_counter() - t, 3)
            # the programs it compiled or read from the compilation cache (no sampler's where compiled ahead)
            compiled = _COMPILED[compiled_before:]
            result["programs_compiled"] = [name for name, _ in compiled]
            result["compile_s"] = round(sum(s for _, s in compiled), 3)
            _emit("eval", cached=False, uri=root.write_json(rel, result) if _PRIMARY else root.uri(rel), **result)
    return 0


def export(parts, step: int | None) -> int:
    """Write checkpoint `step` (default: the newest; 0 or none yet: the starting policy) as a
    Hugging Face folder `export/{step}/`: config.json, model.safetensors (LoRA merged),
    the tokenizer files and generation_config.json; the marker last. A folder already exported
    from the same training config is not written again."""
    from flax import nnx  # worker start: JAX

    from grpo_core.nn.hf import save_hf_model  # worker start: JAX
    from grpo_core.rl.checkpoint import Checkpointer  # worker start: JAX
    from grpo_core.rl.sampler import stop_ids  # worker start: JAX

    cfg, root = parts.cfg, parts.root
    with Checkpointer(root.uri("checkpoints"), max_to_keep=None) as ckpt:
        if step is None:
            step = max(ckpt.all_steps(), default=0)
        stage = f"export/{step}"
        done = root.done_for(stage, cfg.train_hash)
        if done is not None:
            _emit("export", cached=True, uri=root.uri(stage), **done)
            return 0
        t = time.perf_counter()
        # in host memory: the model is written tensor by tensor, and may not fit one chip whole
        graphdef, params = parts.policy_at(ckpt, step, on_host=True)
    if not _PRIMARY:  # the files are process 0's to write
        return 0
    model = nnx.merge(graphdef, params)
    if cfg.model.lora is not None:
        from grpo_core.nn.lora import merge  # worker start: JAX

        model = merge(model)  # W + (alpha / rank) A @ B: a plain model any HF runtime serves
    remove_dead_staging()
    with tempfile.TemporaryDirectory(prefix=f"{STAGING}{os.getpid()}-") as tmp:
        save_hf_model(model, tmp)
        parts.tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(_generation_config(parts, stop_ids(parts.tokenizer)), f, indent=1)
        files = sorted(os.listdir(tmp))
        for name in files:
            root.put_file(os.path.join(tmp, name), f"{stage}/{name}")
    info = {
        "step": step,
        "train_hash": cfg.train_hash,
        "files": files,
        "source": cfg.model_path or cfg.model.preset,
        "lora_merged": cfg.model.lora is not None,
        "seconds": round(time.perf_counter() - t, 3),
    }
    root.mark_done(stage, info)  # last: the folder is complete
    _emit("export", cached=False, uri=root.uri(stage), **info)
    return 0


STAGING = "grpo-export-"  # the export's staging folders in the system's temp folder: grpo-export-{pid}-xxxx


def remove_dead_staging(temp_dir: str | None = None) -> list[str]:
    """Delete the staging folders of exports whose process is gone (a killed export cannot clean
    up after itself); the folders deleted. A running export's folder names its live pid (on this
    machine: a temp folder shared between machines is not one to sweep)."""
    removed = []
    base = temp_dir or tempfile.gettempdir()
    for name in os.listdir(base):
        pid = name[len(STAGING) :].split("-", 1)[0]
        if not (name.startswith(STAGING) and pid.isdigit()) or _alive(int(pid)):
            continue
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        removed.append(os.path.join(base, name))
    return removed


def _alive(pid: int) -> bool:
    return process_alive(pid, None)  # a zombie (killed, not yet reaped) is gone too


def _generation_config(parts, stops: list[int]) -> dict[str, Any]:
    """The source model's generation config (its sampling defaults kept) with our stop and pad ids."""
    gen: dict[str, Any] = {}
    folder = getattr(parts.tokenizer, "folder", None)
    if folder:
        from grpo_core.store.sources import generation_config  # worker start: fsspec

        gen = generation_config(folder)
    gen.update(eos_token_id=stops[0] if len(stops) == 1 else stops, pad_token_id=int(parts.tokenizer.pad_token_id))
    bos = getattr(parts.tokenizer, "bos_id", None)
    if bos is not None:
        gen["bos_token_id"] = int(bos)
    gen.pop("transformers_version", None)
    return gen


def _eval_sampling(cfg):
    return cfg.train.sampling.replace(temperature=cfg.eval.temperature)


# The programs this process compiled (or read from the persistent cache), by name, and the
# seconds each took: JAX's backend-compile event, listened to once a process (_count_compiles).
_COMPILED: list[tuple[str, float]] = []
_EVAL_AHEAD: list = []  # the thread compiling the evaluation's programs while the worker trains


def _count_compiles() -> None:
    import jax  # worker start: JAX

    def on(event: str, duration: float, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            _COMPILED.append((str(kw.get("fun_name", "?")), duration))

    jax.monitoring.register_event_duration_secs_listener(on)


def eval_ahead_enabled() -> bool:
    """GRPO_EVAL_AHEAD: 1 compiles the evaluation's programs in a thread while the worker trains,
    0 when the evaluation starts. Unset: 1 on a TPU, where XLA compiles on the host alone and the
    host's cores idle while the chips train; 0 on a GPU, whose compiler tries candidate kernels on
    the device, beside the training steps and in their memory (on until measured there), and on
    the CPU backend, where the compiler would take its cores from the training steps."""
    import jax  # worker start: JAX

    from grpo_core.config import switches  # worker start: config

    chosen = switches.on_off("GRPO_EVAL_AHEAD")
    return jax.default_backend() == "tpu" if chosen is None else chosen


def _eval_ahead(parts, trainer) -> None:
    """Compile the sampler's programs evaluate_steps will run (greedy, sampled, the examples) in
    a thread, while training runs: otherwise the first evaluation stops to compile them (~28 of
    its 30.8 s on an H100, qwen2.5-0.5b). The policy's shapes and dtypes are
    the trainer's, laid out as the evaluation lays out a checkpoint. A failure here is only
    logged: the evaluation compiles for itself and reports what fails."""
    if not eval_ahead_enabled():
        return
    import jax  # worker start: JAX

    from grpo_core.rl.evaluation import compile_jobs  # worker start: JAX

    cfg = parts.cfg
    placement = _eval_placement(cfg.train.mesh)
    sampling, rows = _eval_sampling(cfg), parts.eval_rows
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # where policy_at commits a policy
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), trainer.params)
    runs = [dict(rows=rows, batch_size=cfg.eval.batch_size)]
    if cfg.eval.num_samples > 1:
        runs.append(dict(rows=rows, batch_size=cfg.eval.batch_size, num_samples=cfg.eval.num_samples))
    runs.append(dict(rows=rows[:_EXAMPLES], batch_size=len(rows[:_EXAMPLES])))  # _examples
    done = threading.Event()

    def compile_all():
        try:
            for run in runs:
                for job in compile_jobs(
                    trainer.graphdef, params, parts.tokenizer, sampling=sampling, placement=placement, **run
                ):
                    job()
        except Exception as exc:  # noqa: BLE001 - the evaluation compiles them again and reports what fails
            print(f"compiling the evaluation's programs ahead failed: {exc!r}", file=sys.stderr, flush=True)
        finally:
            done.set()

    threading.Thread(target=compile_all, daemon=True, name="eval-ahead").start()
    _EVAL_AHEAD.append(done)


def _wait_eval_ahead() -> None:
    """Until the evaluation's programs compiled ahead are ready: compiling one again at the same
    time would compile it twice."""
    while _EVAL_AHEAD:
        _EVAL_AHEAD.pop().wait()


def _eval_placement(mesh):
    """The run's meshes over this host's devices; where train.mesh names sizes these devices do
    not have (a run trained on a slice, evaluated elsewhere), the default mesh over them."""
    from grpo_core.runtime.mesh import Placement  # worker start: JAX

    try:
        return Placement.from_config(mesh)
    except ConfigError as exc:
        print(f"evaluating over the default mesh of this host's devices: {exc}", file=sys.stderr, flush=True)
        return Placement.from_config(None)


_EXAMPLES = 4  # greedy completions an evaluation keeps


def _examples(
    parts, graphdef, params, sampling, placement, turns=None, state=None, n: int = _EXAMPLES
) -> list[dict[str, Any]]:
    """A few greedy completions to read next to the numbers (the demo prints them), each with its
    score by every evaluation reward ("rewards": name -> score, null where one does not apply);
    episodes (train.agent) with their messages: each turn, call and tool result."""
    from grpo_core.generate.sampler import completion_ids  # worker start: JAX
    from grpo_core.rewards import functions as rw  # worker start: numpy
    from grpo_core.rl.evaluation import complete  # worker start: JAX

    rows = parts.eval_rows[:n]
    batches = complete(
        graphdef, params, parts.tokenizer, rows, sampling, batch_size=len(rows), placement=placement, turns=turns
    )
    [(_, texts, (tokens, lengths, count), eps)] = list(batches)
    keep = lambda r: {k: v for k, v in r.items() if k != "prompt_ids" and isinstance(v, (str, int, float))}
    out = [dict(keep(r), completion=c) for r, c in zip(rows, texts)]
    try:
        prompts, completions, columns = rw.reward_inputs(
            rows, texts, completion_ids=completion_ids(tokens, lengths, rows=count), state=state
        )
        whole = None
        if eps is not None:
            from grpo_core.agent import episodes  # worker start: JAX

            columns.update({k: v[:count] for k, v in episodes.reward_columns(eps).items()})
            whole = eps.messages[:count] if completions and isinstance(completions[0], list) else texts
            for example, messages in zip(out, eps.messages):
                example["episode"] = messages
        scored = rw.score(
            parts.eval_rewards,
            prompts,
            completions,
            columns,
            timeout_s=parts.cfg.train.reward_timeout_s,
            batch="the evaluation's examples",
            episodes=whole,
        )
    finally:
        if eps is not None:
            eps.close()
    for i, example in enumerate(out):
        example["rewards"] = {k: (None if math.isnan(v[i]) else float(v[i])) for k, v in scored.per_function.items()}
    return out


def _load(args):
    from grpo_core.config.run import RunConfig  # worker start: config
    from grpo_core.stages.parts import open_run  # worker start: JAX
    from grpo_core.store.root import RunRoot  # worker start: fsspec

    root = RunRoot(args.root)
    raw = json.loads(open(args.config).read()) if args.config else root.read_json("config.json")
    return open_run(RunConfig.from_dict(raw), root)


def _compilation_cache() -> None:
    """Each epoch and each evaluation is a fresh process that compiles the same programs again;
    JAX's persistent compilation cache turns those compilations into loads. The default folder
    is ~/.cache/grpo-pipeline/jax; JAX_COMPILATION_CACHE_DIR chooses another, and
    GRPO_COMPILATION_CACHE=0 turns it off. A local folder keeps every program, the model's
    initialisers run op by op included (a read from disk costs less than the smallest compile:
    0.4 CPU-s less a tiny-model worker); a remote one (gs://...) those that took 0.1 s or more."""
    if os.environ.get("GRPO_COMPILATION_CACHE", "1") == "0":
        return
    import jax  # worker start: JAX

    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        folder = os.path.join(base, "grpo-pipeline", "jax")
        jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1 if "://" in folder else 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grpo_core.stages.worker", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("train", "eval", "export"):
        p = sub.add_parser(name)
        p.add_argument("--root", required=True, help="the run's folder or URL (gs://bucket/prefix/run)")
        p.add_argument("--config", help="JSON run config (default: config.json in the run root)")
        p.add_argument(
            "--distributed",
            action="store_true",
            help="join a multi-host run (jax.distributed; see grpo_core.launch.cluster for the environment)",
        )
    sub.choices["train"].add_argument("--until-step", type=int, required=True, help="train until this many steps")
    sub.choices["train"].add_argument(
        "--then-eval",
        default="",
        help="once trained, evaluate these steps in this process (comma-separated; 0 = starting policy), as eval would",
    )
    sub.choices["train"].add_argument(
        "--then-export", action="store_true", help="once trained (and evaluated), export --until-step, as export would"
    )
    sub.choices["eval"].add_argument("--steps", required=True, help="comma-separated steps; 0 = starting policy")
    sub.choices["export"].add_argument("--step", type=int, help="checkpoint to export (default: the newest)")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    _install_stop_handlers()
    preload()
    _compilation_cache()
    rc = _join(args.distributed) or _run(args)
    print(json.dumps({"event": "exit", "code": rc, "seconds": round(time.perf_counter() - t, 3)}), file=sys.stderr)
    return rc


def _join(requested: bool) -> int:
    """Join the other processes of a multi-host run, if the launcher started several."""
    global _PRIMARY
    from grpo_core.launch import cluster as distributed  # worker start: numpy

    try:
        cluster = distributed.from_env(requested=requested)
        distributed.initialize(cluster)
    except distributed.DistributedError as exc:
        failure = classify(exc)
        _emit("error", kind=failure.event, message=str(exc))
        return failure.code
    if cluster is not None:
        _PRIMARY = distributed.is_primary()
    return 0


def _run(args) -> int:
    try:
        parts = _load(args)
        if args.command == "train":
            if args.until_step < 0:
                raise ConfigError(f"--until-step must be >= 0, got {args.until_step}")
            then_eval = _steps(args.then_eval, "--then-eval")
            rc = train(parts, args.until_step, then_eval, config_file=args.config)
            if rc or _STOP.is_set():
                return rc
            # The stages after training, in this process (tasks.stages.train_epoch asks for them):
            # no second JAX start, restore and compile. Training is durable by now ("done"): a
            # failure from here on is the eval's or export's, which their tasks run again alone.
            if then_eval:
                gc.collect()  # the trainer's optimizer state and programs are garbage now
                evaluate_steps(parts, then_eval)
            return export(parts, args.until_step) if args.then_export and not _STOP.is_set() else 0
        if args.command == "export":
            return export(parts, args.step)
        return evaluate_steps(parts, _steps(args.steps, "--steps"))
    except Exception as exc:
        failure = classify(exc)
        if failure is None and _storage_fault(exc):  # a full or read-only disk under Orbax or TensorStore
            from grpo_core.store.root import describe_storage_error  # worker start: fsspec

            _emit("error", kind="storage", message=describe_storage_error(args.root, exc))
            _exit_now(ExitCode.STORAGE_LASTING)  # each cause _storage_fault knows stays until someone acts
        if failure is None:
            from grpo_core.config import memory  # worker start: config

            if not memory.is_out_of_memory(exc):  # XLA's allocation failures have no class of their own
                raise  # a bug: the traceback is the report, and a crash is retried
            failure = OUT_OF_MEMORY
        _emit(
            "error",
            kind=failure.event,
            message=_out_of_memory_message(exc) if failure.code == ExitCode.MEMORY else str(exc),
        )
        # A thread may still wait inside the engine, or run a reward function that never returns
        # (a daemon thread, but one that holds the GIL in C code stalls interpreter shutdown and
        # the engine's threads are joined there): exit at once, output flushed, without them.
        # So may Orbax's threads of a checkpoint that could not be written (StorageError), each
        # waiting minutes on a signal that never comes.
        if isinstance(exc, (RolloutTimeout, RewardTimeout, StorageError)):
            _exit_now(failure.code)
        return failure.code


def _steps(text: str, flag: str) -> list[int]:
    try:
        return sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _exit_now(code: int) -> None:
    """Exit with `code` at once, output flushed, without joining threads that may never end."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _storage_fault(exc: BaseException) -> bool:
    """A storage fault that reached us as something else than StorageError: an OSError for a full,
    read-only or forbidden file system anywhere in the chain, or TensorStore's text for one."""
    from grpo_core.store.root import exception_chain  # worker start: fsspec

    return any(
        (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM))
        or any(s in str(e) for s in ("No space left on device", "Read-only file system"))
        for e in exception_chain(exc)
    )


def _out_of_memory_message(exc: BaseException) -> str:
    from grpo_core.config import memory  # worker start: config

    peak = memory.peak_bytes()
    where = (
        f"device peak {peak['peak_device_bytes'] / 2**30:.2f} GiB"
        if "peak_device_bytes" in peak
        else f"process peak {peak['peak_rss_bytes'] / 2**30:.2f} GiB"
    )
    return f"out of memory ({where}): {str(exc).splitlines()[0][:300]}; {OUT_OF_MEMORY_LEVERS}"


def preload() -> None:
    """Import what train, eval and export import when they start (a worker started ahead,
    grpo_core.stages.ahead, does it before its stage is known; a worker started for its stage,
    first thing). Imports only: JAX starts its backend, and takes a TPU, at the first array.
    Once per process: a worker that stays runs main once per stage, and a later freeze would keep
    what a stage left for collection out of every collection after it."""
    if _PRELOADED:
        return
    _PRELOADED.append(True)
    with imports_without_gc():
        import grpo_core.config.memory  # noqa: F401 - worker start: config
        import grpo_core.data.prepare  # noqa: F401 - worker start: fsspec
        import grpo_core.rl.checkpoint  # noqa: F401 - worker start: JAX
        import grpo_core.rl.compiler_plan  # noqa: F401 - worker start: JAX
        import grpo_core.rl.evaluation  # noqa: F401 - worker start: JAX
        import grpo_core.rl.trainer  # noqa: F401 - worker start: JAX
        import grpo_core.runtime.mesh  # noqa: F401 - worker start: JAX
        import grpo_core.stages.parts  # noqa: F401 - worker start: JAX
    _count_compiles()


def run_process(argv: list[str] | None = None) -> None:
    """main(argv), then the process ends: not through the interpreter's finalisation, which frees
    every module, array and compiled program one by one (half a second of a tiny run's worker, at
    every stage; the OS frees them at once). Everything is written by now; the exit handlers
    still run."""
    end_process(main(argv))


def end_process(code: int) -> None:
    """The process ends with `code`: its exit handlers run, its finalisation is skipped (run_process)."""
    atexit._run_exitfuncs()
    _exit_now(code)


if __name__ == "__main__":
    run_process()
