"""The pipeline's Prefect tasks. Each is thin: it reads the run's config from the run root, runs
one grpo_core stage (in a worker process when it touches an accelerator), reports to Prefect
(logs, artifacts) and returns URIs and small numbers. Stage outputs and their completion
markers live in the run root, so a retried or re-run stage finds finished work and skips it.

Retries are for failures a retry can fix (a crash, a kill, preemption, a storage hiccup, a time
limit): `retryable` reads StageError.retryable; config, data and reward errors fail at once.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from prefect.client.schemas.sorting import ArtifactSort
from prefect.runtime import flow_run

from grpo_core.config.launch import LauncherKind
from grpo_core.config.run import RunConfig
from grpo_core.data.prepare import DataError
from grpo_core.data.prepare import prepare_dataset as prepare
from grpo_core.data.tokenizer import make_tokenizer
from grpo_core.errors import ConfigError, ExitCode, RewardFunctionError, storage_cause_lasts
from grpo_core.rewards.probe import check_prepared
from grpo_core.rewards.registry import config_rewards
from grpo_core.store.report import eval_results, latest_checkpoint, read_eval
from grpo_core.store.root import RunRoot, StorageError
from grpo_core.store.runs import init_run_root
from grpo_core.store.tracking import Trackers
from tasks import progress as shown_progress
from tasks.artifacts import flow_run_artifact
from tasks.process import StageError, run_worker
from tasks.readiness import readiness_markdown, readiness_report, worker_python


def can_retry(exc: BaseException) -> bool:
    """Whether running the stage (or the flow) again can help: crashes, kills, storage errors and
    time limits; never what would fail the same way again (config, data, reward functions,
    divergence) nor an interrupted run (the user or a scheduler asked it to stop)."""
    if isinstance(exc, StageError):
        return exc.retryable
    if isinstance(exc, StorageError) and storage_cause_lasts(exc):  # permission, read-only, a file, no space
        return False
    # RewardFunctionError: the data stage's reward probe (a reward that hangs or fails there)
    return not isinstance(exc, (ConfigError, DataError, RewardFunctionError, ValueError, TypeError, KeyboardInterrupt))


def retryable(task_, task_run, state) -> bool:
    """retry_condition_fn of every stage task: can_retry of the exception it raised."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - judged by can_retry
        return can_retry(exc)
    return True


def _progress_artifact(key: str, pct: float, described) -> Any:
    """The id of this flow run's progress artifact `key`, set to `pct`: the one an earlier epoch
    or attempt (a task or flow retry) of this flow run made, else a new one. Before, every epoch
    and attempt made its own (15 after a flow retry)."""
    if flow_run.id:
        try:
            with get_client(sync_client=True) as client:
                found = client.read_artifacts(
                    artifact_filter=ArtifactFilter(
                        key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])
                    ),
                    sort=ArtifactSort.CREATED_DESC,
                    limit=1,
                )
            if found and found[0].type == "progress":
                update_progress_artifact(found[0].id, pct, description=described(pct))
                return found[0].id
        except Exception:  # noqa: BLE001 - a new artifact then, as before
            pass
    return flow_run_artifact("progress", pct, key=key, description=described(pct))  # the flow run's (tasks.artifacts)


# The progress artifact's updates: every 1 % of the run, but at least PROGRESS_MIN_S apart (the
# demo's 40-ms steps made that 4 writes a second to the server, whose SQLite fails a write that
# meets another: issue 30, item 7), and at most PROGRESS_MAX_S apart; an epoch's last step always.
PROGRESS_MIN_S, PROGRESS_MAX_S = 5.0, 10.0


def progress_due(steps_since: int, seconds_since: float, total: int, last: bool) -> bool:
    """Whether the step just done updates the progress artifact (see PROGRESS_MIN_S)."""
    if last or seconds_since >= PROGRESS_MAX_S:
        return True
    return steps_since >= total / 100 and seconds_since >= PROGRESS_MIN_S


def _key(name: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")[:90]


def load_run(run_url: str) -> RunConfig:
    root = RunRoot(run_url)
    try:
        return RunConfig.from_dict(root.read_json("config.json"))
    except FileNotFoundError as exc:
        raise ConfigError(f"{exc}: start the run with grpo_pipeline, which writes it first") from None


def _workers_elsewhere(cfg: RunConfig) -> bool:
    """Whether the workers run on other hosts (ray, tpu-vm), where a reward file or module may
    exist that this machine lacks: then only the rewards found here are checked here."""
    return cfg.pipeline.launcher.kind in (LauncherKind.RAY, LauncherKind.TPU_VM)


@task(name="init-run", cache_policy=NO_CACHE)
def init_run(config: dict[str, Any]) -> str:
    """Validate the config and write it to {run}/config.json (refused if the run folder holds
    another training config)."""
    cfg = RunConfig.from_dict(config)
    # Resolve every reward (training and eval) now, in the first seconds: a missing file or
    # function, an import error or a signature that cannot take (prompts, completions, **columns)
    # otherwise surfaces only in the training worker, after data preparation and readiness.
    # ConfigError names rewards[i].function. Reward code is JAX-free.
    config_rewards(cfg, skip_missing=_workers_elsewhere(cfg))
    init_run_root(cfg)
    log = get_run_logger()
    log.info("run %s: %s", cfg.name, cfg.run_url)
    start = cfg.start_point
    if start is not None:
        log.info(
            "starting from %s (step %d of %s), KL reference: %s",
            start.uri,
            start.step,
            start.run_url,
            cfg.model.reference.value,
        )
    for warning in cfg.train.grpo.warnings():  # runs, but not as the papers and TRL advise
        log.warning(warning)
    return cfg.run_url


@task(name="prepare-dataset", cache_policy=NO_CACHE)
def prepare_dataset(run_url: str) -> dict[str, Any]:
    """Read, template, tokenize, filter and split the prompts into {run}/data/{hash}/."""
    cfg, log = load_run(run_url), get_run_logger()
    manifest = prepare(cfg.data, make_tokenizer(cfg), RunRoot(run_url), cfg.tokenizer_id, cfg.data_versions)
    log.info(
        "dataset %s: %d train / %d eval prompts (%s)%s",
        manifest["hash"],
        manifest["train_rows"],
        manifest["eval_rows"],
        cfg.data.source,
        ", already prepared" if manifest.get("cached") else "",
    )
    # A reward that can score none of these rows (math_answer without a ground_truth column)
    # would train on nothing and still "complete": try each on a few rows now (DataError, not
    # retried). On data prepared by an earlier attempt too: it costs well under a second.
    for found in check_prepared(cfg, RunRoot(run_url), skip_missing=_workers_elsewhere(cfg)):
        log.info("reward probe: %s", found.describe())
    return {k: manifest.get(k) for k in ("uri", "hash", "train_rows", "eval_rows", "dropped_too_long", "cached")}


def publish_readiness(report: dict[str, Any], run_name: str) -> None:
    """The report as a markdown artifact; StageError (not retryable) naming each failed check."""
    create_markdown_artifact(
        readiness_markdown(report), key=_key(f"readiness-{run_name}"), description="Preflight checks"
    )
    failed = [f"{c['name']}: {c['detail']} (fix: {c['fix']})" for c in report["checks"] if not c["ok"]]
    if failed:
        raise StageError("not ready: " + "; ".join(failed), retryable=False, code=ExitCode.NOT_READY)


def nothing_left(cfg: RunConfig, root: RunRoot) -> bool:
    """Whether every stage that needs the devices is done for this config: each epoch trained
    (its marker, same training hash), each evaluated step stored (same eval hash), the export
    written. A scheduled or repeated run of a finished config then starts no worker process."""
    ends = [cfg.epoch_end(e) for e in range(cfg.pipeline.epochs)]
    if any(root.done_for(f"stages/train-epoch-{e}", cfg.train_hash) is None for e in range(cfg.pipeline.epochs)):
        return False
    if any(_evaluated(cfg, root, step) is None for step in [0, *ends]):
        return False
    return not cfg.pipeline.export or root.done_for(f"export/{ends[-1]}", cfg.train_hash) is not None


def _evaluated(cfg: RunConfig, root: RunRoot, step: int) -> dict[str, Any] | None:
    """The stored evaluation of `step` when it is this eval config's, else None."""
    rel = f"eval/{step}.json"
    result = read_eval(root, rel) if root.exists(rel) else None
    return result if result is not None and result.get("eval_hash") == cfg.eval_hash else None


@task(name="check-readiness", cache_policy=NO_CACHE)
def check_readiness(run_url: str) -> dict[str, Any]:
    """Preflight: storage, devices, memory budget. Writes readiness.json; fails fast if not ready.
    Skipped (no worker started) when every stage that needs the devices is done."""
    cfg, log = load_run(run_url), get_run_logger()
    if nothing_left(cfg, RunRoot(run_url)):
        log.info("every stage of this run is done: readiness not checked (no device is needed)")
        return {"ready": True, "skipped": True}
    report = readiness_report(cfg, handover=True)  # a local run's first training worker checks its devices
    RunRoot(run_url).write_json("readiness.json", report)
    for c in report["checks"]:
        log.info("readiness %-16s %s  %s", c["name"], "ok" if c["ok"] else "FAILED", c["detail"])
    publish_readiness(report, cfg.name)
    return {"ready": True, "backend": report.get("backend"), "device_count": report.get("device_count")}


def _follow_ups(cfg: RunConfig, root: RunRoot, eval_steps: list[int], export: bool) -> list[str]:
    """The training worker's arguments for the stages after it that it can run itself, in the
    same process (grpo_core.stages.worker train --then-eval/--then-export): the steps of
    `eval_steps` not yet evaluated with this eval config, and the export. Only a worker that is one
    local process of this interpreter: evaluation and export run alone in this interpreter (a
    multi-host set, or sglang-jax's environment, trains elsewhere). Their tasks still run, read
    what the worker wrote and start a process only for what is missing (a failed follow-up)."""
    if cfg.pipeline.launcher.kind is not LauncherKind.LOCAL or worker_python(cfg) != sys.executable:
        return []
    steps = [s for s in eval_steps if _evaluated(cfg, root, s) is None]
    return (["--then-eval", ",".join(map(str, steps))] if steps else []) + (["--then-export"] if export else [])


@task(name="train-epoch", task_run_name="train-epoch-{epoch}", cache_policy=NO_CACHE)
def train_epoch(run_url: str, epoch: int, eval_steps: list[int] | None = None, export: bool = False) -> dict[str, Any]:
    """Train until the end of `epoch` in a worker process, resuming from the newest checkpoint;
    then, in the same process, evaluate `eval_steps` and (`export`) export the epoch's end, which
    the evaluate and export tasks read back (each runs alone in a process of its own when this
    worker's part failed: trained steps are kept)."""
    cfg, log, root = load_run(run_url), get_run_logger(), RunRoot(run_url)
    stage, until = f"stages/train-epoch-{epoch}", cfg.epoch_end(epoch)
    done = root.done_for(stage, cfg.train_hash)
    if done is not None:
        log.info("epoch %d already trained (steps up to %d): skipped", epoch, until)
        return dict(done, skipped=True)
    start_step = cfg.epoch_end(epoch - 1) if epoch > 0 else 0
    newest = latest_checkpoint(root)
    if newest is not None and newest > until:
        # A later epoch's checkpoint exists, so this epoch was trained and only its marker is gone
        # (deleted by hand, or a copy of the run root without it): rebuild it from the metrics, at
        # this epoch's end, without starting a worker that would resume from `newest`.
        info = _epoch_info(root, cfg, epoch, until, steps_run=0, seconds=0.0, train_steps_s=0.0, first_steps_s=0.0)
        root.mark_done(stage, dict(info, rebuilt=True))
        log.warning(
            "epoch %d: its marker was missing while checkpoint %d (a later epoch's) exists: marker rebuilt "
            "from the metrics (step %d, reward %s)",
            epoch,
            newest,
            until,
            info["reward"],
        )
        return dict(info, skipped=True)
    # The whole run's progress (steps done of train.num_steps), from where a resumed attempt
    # starts: its newest checkpoint at or before this epoch's end.
    total = max(1, cfg.train.num_steps)
    resumed_at = max(start_step, newest if newest is not None else 0)

    def described(pct: float) -> str:  # the UI's artifact card shows the description, not the number
        return f"{pct:.0f}% - training {cfg.name}: steps done of {total} (epoch {epoch}: steps {start_step}..{until})"

    progress = _progress_artifact(_key(f"train-{cfg.name}"), 100.0 * resumed_at / total, described)
    every = shown_progress.step_every(cfg.train.num_steps, cfg.train.log_every)  # ~50 step lines a run
    lines = shown_progress.TrainLog(epoch, cfg.train.num_steps, until, every)
    evals = shown_progress.EvalLog()
    rollout = shown_progress.RolloutLog()  # the rollout side of an asynchronous run
    trackers = _trackers(cfg, root, log)
    shown = {"step": resumed_at, "t": time.monotonic()}
    # eval_s: seconds of the evaluations this worker ran after training
    state: dict[str, Any] = {
        "last": None,
        "steps_s": 0.0,
        "first_step_s": None,
        "unscored": 0,
        "done": None,
        "eval_s": 0.0,
    }

    def on_event(e: dict[str, Any]) -> None:
        kind = e["event"]
        if kind in ("start", "resumed"):
            log.info("epoch %d: %s at step %d, training until %d", epoch, kind, e["step"], e["until"])
        elif kind == "rollout_side":
            log.info("epoch %d: %s", epoch, rollout.started(e))
        elif kind == "step":
            state["last"] = e
            # at the steps done after it (a step event's "step" counts from 0), as checkpoints and evaluations
            # count: a tracker's curve of eval/* lines up with the training curve (issue 65)
            trackers.log(int(e["step"]) + 1, e)
            state["steps_s"] += e["time/step"]
            if state["first_step_s"] is None:  # the first step of a process includes compilation
                state["first_step_s"] = e["time/step"]
            s = int(e["step"]) + 1
            side = rollout.step(e)
            if lines.step(s):
                log.info(
                    "step %d/%d  reward %.3f  kl %.4f  entropy %.3f  %.0f ms/step%s%s",
                    s,
                    cfg.train.num_steps,
                    e["reward"],
                    e["kl"],
                    e["entropy"],
                    1000 * e["time/step"],
                    side,
                    lines.step_suffix(s),
                )
            if (eta := lines.eta(s)) is not None:
                log.info(eta)
            if e.get("frac_rows_scored") == 0.0:  # every row left out of the loss: reward NaN, loss 0
                state["unscored"] += 1
                if state["unscored"] == 1 or s % every == 0 or s == until:  # the first, then with the log lines
                    log.warning(
                        "step %d: no reward scored any completion (every reward returned None), so the step "
                        "learned nothing; %d such step(s) in this epoch so far",
                        s,
                        state["unscored"],
                    )
            if progress_due(s - shown["step"], time.monotonic() - shown["t"], total, s == until):
                pct = 100.0 * min(1.0, s / total)
                update_progress_artifact(progress, pct, description=described(pct))
                shown.update(step=s, t=time.monotonic())
        elif kind == "checkpoint":  # with the step lines: the first, then the first after each step line
            if (unsaid := lines.checkpoint(int(e["step"]))) is not None:
                log.info(shown_progress.checkpoint_line(e["uri"], unsaid))
        elif kind == "checkpoint_set_aside":  # names the bad folder, where it went and what resumes
            log.warning("epoch %d: %s", epoch, e["message"])
        elif kind == "no_signal":  # every group's rewards equal for pipeline.zero_signal_steps steps
            log.warning("epoch %d: %s", epoch, e["message"])
        elif kind in ("memory", "memory_xla"):  # the plan; remat and accumulation chosen by the backend's compiler
            log.info("memory: %s", e["describe"])
        elif kind == "done":
            state["done"] = e
        elif kind == "eval_progress":
            _eval_progress(log, evals, e)
        elif kind == "eval":  # a follow-up: the epoch's evaluation in this worker
            _log_eval(log, e)
            if not e["cached"]:
                state["eval_s"] += e.get("seconds", 0.0)
                trackers.log(int(e["step"]), {k: v for k, v in e.items() if k != "seconds"}, kind="eval")
        elif kind == "export":
            log.info("exported step %d as a Hugging Face model: %s", e["step"], e["uri"])

    follow_ups = _follow_ups(cfg, root, eval_steps or [], export)
    t = time.perf_counter()
    try:
        run_worker(
            ["grpo_core.stages.worker", "train", "--root", run_url, "--until-step", str(until), *follow_ups],
            timeout_s=cfg.pipeline.train_timeout_s,
            timeout_field="pipeline.train_timeout_s",
            on_event=on_event,
            what=f"training epoch {epoch}" + (" and its evaluation or export" if follow_ups else ""),
            python=worker_python(cfg),
            launcher=cfg.pipeline.launcher,
            next_stage=epoch + 1 < cfg.pipeline.epochs,  # the next epoch's worker imports while this one trains
        )
    except StageError as exc:
        if state["done"] is None or state["done"]["step"] != until:
            raise
        # Trained to the end ("done" follows the final checkpoint): what failed is a follow-up,
        # which its own task runs again in a process of its own. The steps are kept.
        log.warning(
            "epoch %d trained to step %d; the evaluation or export in its worker failed, so its task runs it "
            "in a process of its own: %s",
            epoch,
            until,
            exc,
        )
    finally:
        trackers.close()
        _rollout_artifact(cfg, epoch, rollout)
    done = state["done"]
    if done is None:
        raise StageError(f"training epoch {epoch} ended without saying it was done", retryable=True)
    if done["step"] != until:  # the worker trains to exactly --until-step from any checkpoint at or before it
        raise StageError(f"training epoch {epoch} ended at step {done['step']}, not at its end ({until})")
    info = _epoch_info(
        root,
        cfg,
        epoch,
        until,
        steps_run=done["steps_run"],
        seconds=time.perf_counter() - t,
        train_steps_s=state["steps_s"],
        first_steps_s=state["first_step_s"] or 0.0,
    )
    root.mark_done(stage, info)  # after the worker's checkpoint is final: the marker is last
    pct = 100.0 * min(1.0, until / total)
    update_progress_artifact(progress, pct, description=described(pct))
    return dict(info, skipped=False, eval_compute_s=round(state["eval_s"], 3))


def _rollout_artifact(cfg: RunConfig, epoch: int, rollout: shown_progress.RolloutLog) -> None:
    """An asynchronous epoch's rollout side as a table artifact (its version, staleness and waits),
    failed attempts included: a failed rollout process shows where it stopped."""
    row = rollout.row(epoch)
    if row is None:
        return
    try:
        create_table_artifact(
            [row],
            key=_key(f"rollout-{cfg.name}-epoch-{epoch}"),
            description=f"The rollout side of epoch {epoch}: versions, staleness, the seconds each side waited",
        )
    except Exception as exc:  # noqa: BLE001 - reported after the stage's outcome, never instead of it
        get_run_logger().warning("the rollout side's artifact of epoch %d was not written: %s", epoch, exc)


def _trackers(cfg: RunConfig, root: RunRoot, log) -> Trackers:
    """pipeline.report_to's trackers for this task; a failing one is reported once and dropped."""
    return Trackers(root, cfg.pipeline.report_to, cfg.name, cfg.pipeline.tracking_project, warn=log.warning)


def _epoch_info(root: RunRoot, cfg: RunConfig, epoch: int, step: int, **timing: float) -> dict[str, Any]:
    """An epoch's marker: its last step and that step's reward, read from the metrics (a worker
    that resumed at the epoch's end ran no step of its own to report one)."""
    row = next((m for m in reversed(root.read_metrics()) if int(m["step"]) == step - 1), None)
    reward = row.get("reward") if row else None
    return {
        "epoch": epoch,
        "step": step,
        "steps_run": int(timing.pop("steps_run")),
        "train_hash": cfg.train_hash,
        "checkpoint_uri": root.uri("checkpoints", str(step)),
        "reward": reward if isinstance(reward, (int, float)) and math.isfinite(reward) else None,
        **{k: round(v, 3) for k, v in timing.items()},
    }


@task(name="export", task_run_name="export-{step}", cache_policy=NO_CACHE)
def export_model(run_url: str, step: int) -> dict[str, Any]:
    """The policy at `step` as a Hugging Face folder {run}/export/{step}/ (safetensors, config,
    tokenizer, generation config; LoRA merged), written by a worker process, marker last."""
    cfg, log, root = load_run(run_url), get_run_logger(), RunRoot(run_url)
    if root.done_for(f"export/{step}", cfg.train_hash) is not None:  # no process to start
        log.info("step %d already exported as a Hugging Face model: %s", step, root.uri(f"export/{step}"))
        return {"uri": root.uri(f"export/{step}"), "step": step, "cached": True}
    events = run_worker(
        ["grpo_core.stages.worker", "export", "--root", run_url, "--step", str(step)],
        timeout_s=cfg.pipeline.export_timeout_s,
        timeout_field="pipeline.export_timeout_s",
        on_event=lambda e: None,
        what=f"export of step {step}",
        launcher=cfg.pipeline.launcher.single(),
    )
    done = next(e for e in events if e["event"] == "export")
    log.info(
        "exported step %d as a Hugging Face model: %s%s",
        step,
        done["uri"],
        " (already exported)" if done["cached"] else "",
    )
    return {"uri": done["uri"], "step": step, "cached": done["cached"]}


def eval_table(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of the eval table artifact; a NaN score (a mean over no scored row) is None, since
    Prefect's API takes strict JSON."""
    rnd = lambda v: round(v, 4) if v == v else None  # noqa: E731 - NaN != NaN
    rows = []
    for r in results:
        row = {"step": r["step"], "accuracy": rnd(r["accuracy"]), "reward": rnd(r["greedy"]["reward_mean"])}
        row.update({k: rnd(v) for k, v in r.items() if k.startswith("pass@")})
        rows.append(row)
    return rows


def _eval_progress(log, evals: shown_progress.EvalLog, e: dict[str, Any]) -> None:
    """An evaluation's prompts done: a log line now and then when it is long."""
    if evals.due(e["step"], e["done"], e["total"]):
        log.info("eval step %d: %d of %d prompts done", e["step"], e["done"], e["total"])


def _log_eval(log, e: dict[str, Any]) -> None:
    extra = " ".join(f"{k} {v:.3f}" for k, v in e.items() if k.startswith("pass@"))
    log.info(
        "eval step %d: accuracy %.3f %s%s",
        e["step"],
        e["accuracy"],
        extra,
        " (already evaluated)" if e["cached"] else "",
    )


@task(name="evaluate", task_run_name="evaluate-{steps}", cache_policy=NO_CACHE)
def evaluate(run_url: str, steps: list[int]) -> dict[str, Any]:
    """Greedy accuracy and pass@k on the eval split for the given checkpoints (0: the starting
    policy), in a worker process; each result lands in {run}/eval/{step}.json."""
    cfg, log, root = load_run(run_url), get_run_logger(), RunRoot(run_url)

    evals = shown_progress.EvalLog()

    def on_event(e: dict[str, Any]) -> None:
        if e["event"] == "eval_progress":
            _eval_progress(log, evals, e)
        elif e["event"] == "eval":
            _log_eval(log, e)

    stored = [_evaluated(cfg, root, s) for s in steps]
    if all(r is not None for r in stored):
        events = [dict(r, event="eval", cached=True) for r in stored]  # no process to start
        for e in events:
            on_event(e)
    else:
        events = run_worker(
            ["grpo_core.stages.worker", "eval", "--root", run_url, "--steps", ",".join(map(str, steps))],
            timeout_s=cfg.pipeline.eval_timeout_s,
            timeout_field="pipeline.eval_timeout_s",
            on_event=on_event,
            what=f"evaluation of steps {steps}",
            launcher=cfg.pipeline.launcher.single(),
        )
    results = {
        str(e["step"]): {k: v for k, v in e.items() if k == "accuracy" or k.startswith("pass@")}
        for e in events
        if e["event"] == "eval"
    }
    table = eval_table(eval_results(root))
    create_table_artifact(table, key=_key(f"eval-{cfg.name}"), description="Evaluation on the eval split, per step")
    fresh = [e for e in events if e["event"] == "eval" and not e["cached"]]
    if fresh and cfg.pipeline.report_to:
        trackers = _trackers(cfg, root, log)
        for e in fresh:
            trackers.log(int(e["step"]), {k: v for k, v in e.items() if k != "seconds"}, kind="eval")
        trackers.close()
    computed = sum(e.get("seconds", 0.0) for e in fresh)
    return {"results": results, "eval_compute_s": round(computed, 3)}
