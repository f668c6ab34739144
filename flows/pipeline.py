"""The GRPO pipeline as one Prefect flow: init → prepare data → readiness → (train epoch →
evaluate)* → export → summary. The flow only calls tasks in order; every output lives in the run root.

A second run of the same config (a retry, a schedule, a click in the UI) walks the same path:
finished stages are skipped by their markers, training resumes from the newest checkpoint,
evaluated steps are read back. At the end `summary.json` (status, steps, reward and eval before
and after, checkpoint) and `curve.png` land in the run root, with a markdown artifact.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import time
import traceback
from typing import Any, Optional

import coolname  # Prefect's dependency: the words of the server's generated names
from prefect import flow, get_client, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import TerminationSignal
from prefect.runtime import deployment, flow_run
from prefect.states import Failed, State

from flows.logs import attach as _attach_log_filter
from flows.logs import stop_level, stop_reason
from flows.params import RunParams
from flows.pool_record import pool_record_refusal
from grpo_core.config.run import RunConfig, check_run_name, is_template
from grpo_core.errors import ConfigError, RunRootInUse, StorageError
from grpo_core.launch.launchers import drop_ahead
from grpo_core.resolve import resolve_run
from grpo_core.rewards.trust import TrustPolicy, check_folder, check_reads, refused_job_variables
from grpo_core.store.lease import RunLease
from grpo_core.store.report import build_summary, checkpoint_steps, plot_curve
from grpo_core.store.root import RunRoot, check_reachable, remove_stale_temp
from grpo_core.store.runs import check_run_root
from tasks.artifacts import flow_run_artifact
from tasks.process import StageError, ahead_scope
from tasks.readiness import readiness_report
from tasks.stages import (
    _key,
    can_retry,
    check_readiness,
    evaluate,
    export_model,
    init_run,
    load_run,
    prepare_dataset,
    publish_readiness,
    retryable,
    train_epoch,
)

_attach_log_filter()  # after a cancel, Prefect's own lines say so (flows.logs), not "Crashed" at ERROR


@task(name="summarize", cache_policy=NO_CACHE)
def summarize(run_url: str, status: str, extra: dict[str, Any], this: dict[str, Any]) -> dict[str, Any]:
    """summary.json, curve.png and a markdown artifact from what the run root holds. `this` is
    this invocation's timing and whether it did any work (see run_timing)."""
    with _store_warnings_in(get_run_logger()):  # a damaged metrics line: in the flow run's own log too
        return _summarize(run_url, status, extra, this)


@contextlib.contextmanager
def _store_warnings_in(log: Any):
    """The run root's warnings (grpo_core.store: a damaged metrics line left out) in `log`, the
    flow run's log in the UI, not only on the serving process's stderr."""

    class Relay(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            log.warning("%s", record.getMessage())

    store, relay = logging.getLogger("grpo_core.store"), Relay(logging.WARNING)
    store.addHandler(relay)
    try:
        yield
    finally:
        store.removeHandler(relay)


def _summarize(run_url: str, status: str, extra: dict[str, Any], this: dict[str, Any]) -> dict[str, Any]:
    root = RunRoot(run_url)
    if not this["did_work"] and root.exists("curve.png"):  # nothing new to draw
        png, curve = root.read_bytes("curve.png"), root.uri("curve.png")
    else:
        png = plot_curve(root)
        curve = root.write_bytes("curve.png", png) if png else None
    timing = run_timing(root, this["timing"], this["did_work"])
    last = {"wall_s": round(this["timing"]["wall_s"], 2), "did_work": this["did_work"]}
    summary = build_summary(root, status, curve_uri=curve, timing=timing, last_invocation=last, **extra)
    root.write_json("summary.json", summary)
    name = run_url.rsplit("/", 1)[-1]
    # The curve is embedded in the artifact (a data URI), so the UI shows it wherever the run
    # root is: a link to a local path or a gs:// object opens nothing in a browser.

    # The same key on every attempt: the artifact's latest version is the run's summary. Each
    # version says which attempt of the flow run wrote it, so a failed attempt's summary beside
    # the completed one in the flow run's artifacts reads as the earlier attempt it is.
    attempt = int(flow_run.run_count or 1)
    markdown = summary_markdown(summary, png, attempt=attempt)
    # The flow run's own artifact, not this task's (tasks.artifacts): first in the flow run's tab.
    flow_run_artifact(
        "markdown", markdown, key=_key(f"summary-{name}"), description=f"GRPO run summary: {status}, attempt {attempt}"
    )
    return summary


def run_timing(root: RunRoot, this: dict[str, float], did_work: bool) -> dict[str, float]:
    """The run's timing: the sum over the invocations of it that did work (trained, evaluated,
    exported, or failed trying), read from the previous summary.json. A re-run that found every
    stage done leaves it as it was; its own wall time is in summary.json's last_invocation."""
    prev = root.read_json("summary.json").get("timing") if root.exists("summary.json") else None
    prev = prev if isinstance(prev, dict) else {}
    if not did_work and prev:
        return prev
    return {k: round(float(prev.get(k, 0.0)) + v, 2) for k, v in this.items()}


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else ("—" if v is None else str(v))


def summary_markdown(s: dict[str, Any], curve_png: bytes | None = None, attempt: int = 1) -> str:
    before, after = s.get("eval_before") or {}, s.get("eval_after") or {}
    keys = sorted({k for k in (*before, *after) if k != "step"})
    lines = [
        f"## GRPO run: {s['status']}" + (f" (attempt {attempt} of this flow run)" if attempt > 1 else ""),
        "",
        f"- run: `{s['run_uri']}`",
        f"- steps: {s['steps']}",
        *(
            [f"- started from: `{s['started_from']['uri']}` (step {s['started_from']['step']} of that run)"]
            if s.get("started_from")
            else []
        ),
        f"- training reward: {_fmt(s['reward_mean_first'])} (first tenth) → {_fmt(s['reward_mean_last'])} (last tenth)",
        f"- checkpoint: `{s['checkpoint_uri']}`",
        f"- Hugging Face export: `{s.get('export_uri')}`",
    ]
    if s.get("curve_uri"):
        lines.append(f"- curve: `{s['curve_uri']}`")
    if curve_png:
        lines += ["", f"![training reward and eval accuracy against steps]({png_data_uri(curve_png)})"]
    if s.get("error"):
        lines.append(f"- error: {s['error']}")
    if keys:
        lines += ["", "| eval | before | after |", "|---|---|---|"]
        lines += [f"| {k} | {_fmt(before.get(k))} | {_fmt(after.get(k))} |" for k in keys]
    return "\n".join(lines)


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _set_flow_retries(log, retries: int | None = None) -> None:
    """This flow run's retry budget on the server, whose RetryFailedFlows rule retries a failed
    flow run while run_count <= empirical_policy.retries, with no condition of its own. The
    decorator's `retries` only seeds that budget, so a deployment run (the form, a schedule, the
    API) would retry as the decorator says whatever the config asks: `retries` sets it to the
    config's pipeline.flow_retries, the same on every path. None: no more retries (what this run
    has used), for an error that fails the same way every time (config, data, reward, a stage's
    non-retryable exit), which would otherwise run the whole pipeline again."""
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run.id)
            want = max(0, (run.run_count or 1) - 1) if retries is None else retries
            if run.empirical_policy.retries != want:
                policy = run.empirical_policy.model_copy(update={"retries": want})
                client.update_flow_run(run.id, empirical_policy=policy)
    except Exception as exc:  # noqa: BLE001 - at worst the flow runs as often as its decorator says
        log.warning("could not set this flow run's retries: %s", exc)


def _no_flow_retry(log) -> None:
    """Fail this flow run for good (see _set_flow_retries)."""
    _set_flow_retries(log, None)


def _error_text(exc: BaseException) -> str:
    """summary.json's error: the exception, and for a TerminationSignal (which says nothing, not
    even its signal) who stopped the run: a cancel in the UI or API, `grpo serve` stopped (it
    leaves its reason in a file named after the flow run), or another SIGTERM."""
    if not isinstance(exc, TerminationSignal):
        return f"{type(exc).__name__}: {exc}"
    return f"stopped by SIGTERM: {stop_reason()}"


def _config(config: RunParams | dict[str, Any] | None) -> RunConfig:
    # A mapping is read as the form's parameters are: an empty (null) field is the config's default.
    return (config if isinstance(config, RunParams) else RunParams.model_validate(config or {})).to_config()


def _allowed(make_config, log: Any, run_url: str | None = None) -> RunConfig:
    """The config `make_config()` builds, refused (ConfigError naming the field, the flow run not
    retried) when it is invalid or, in a deployment run, names what the operator did not allow
    (allowed_config), or the run's work-pool deployment is not as deployments/*.yaml deploys it
    (flows.pool_record). `run_url`: the evaluate deployment's run folder, checked before anything
    is read from it. A direct call (the CLI) is the local user's. `grpo serve` makes the same
    check before it starts a flow run's process (flows.serve_runner); this one is the flow's own,
    for every other way a deployment run starts (a work-pool worker)."""
    try:
        if deployment.id is not None:
            job_variables = _job_variables(log)
            why = refused_job_variables(job_variables) or pool_record_refusal(deployment.id)
            if why:
                raise ConfigError(why)
            return allowed_config(make_config, job_variables, run_url)
        return make_config()
    except ConfigError as exc:
        _no_flow_retry(log)
        raise _refusal(exc, log) from None


def allowed_config(make_config, job_variables: dict[str, Any] | None, run_url: str | None = None) -> RunConfig:
    """The config `make_config()` builds for a deployment run, or ConfigError naming every field
    that names what the operator did not allow: code, programs, places, addresses, or more work
    than the limits (grpo_core.rewards.trust), and job variables that would set the policy itself.
    The policy is read from this process's environment, which the operator set where the flow
    runs (grpo serve, a work-pool worker), never from anything the API can edit. `run_url`: the
    evaluate deployment's run folder, checked (its files by what they resolve to) before its
    config is read."""
    why = refused_job_variables(job_variables)
    if why:
        raise ConfigError(why)
    policy = TrustPolicy.from_env()
    if run_url is not None:
        policy.check_run_url(run_url)
        check_folder(policy, "run_url", run_url, run_url)  # its files: what they resolve to
    cfg = make_config()
    policy.check(cfg)
    check_reads(policy, cfg)  # a link in a data or model folder is read as its target
    return cfg


def _refusal(exc: ConfigError, log: Any) -> ConfigError:
    """What a flow raises for a config refused before any task ran: in a deployment run, Refused
    (one clear line in the run's log, not a traceback); in a direct call (the CLI), `exc` itself."""
    if deployment.id is None:
        return exc
    if log is not None:
        log.error("refused before any task ran: ConfigError: %s", exc)
    return Refused(Failed(message=f"ConfigError: {exc}"))


class Refused(ConfigError):  # noqa: N818 - not an error of the run: the caller's input refused
    """A deployment run's config refused (by the trust policy, or invalid): the flow returns
    `state`, a Failed state whose message names every refused field, and Prefect logs no
    traceback for what is the caller's input, not a fault of the run."""

    def __init__(self, state: Any):
        super().__init__(state.message.removeprefix("ConfigError: "))
        self.state = state


def _job_variables(log: Any) -> dict[str, Any]:
    """This flow run's job variables and its deployment's (what a work pool's worker applies)."""
    try:
        with get_client(sync_client=True) as client:
            return job_variables_of(client.read_deployment(deployment.id), client.read_flow_run(flow_run.id))
    except Exception as exc:  # noqa: BLE001 - the API is what runs this flow: reading it fails the run
        raise ConfigError(f"could not read this flow run's job variables to check them: {exc}") from None


def job_variables_of(*records: Any) -> dict[str, Any]:
    """The environment the job variables of these records set (a deployment's, then its flow
    run's, which wins), as allowed_config checks them."""
    found: dict[str, Any] = {"env": {}}
    for record in records:
        found["env"].update((getattr(record, "job_variables", None) or {}).get("env") or {})
    return found


FLOW_RUNS = "_flow-runs"  # under storage.root: the run_name each flow run filled its template in to


def _fill_run_name(cfg: RunConfig, log: Any = None) -> RunConfig:
    """A run_name template ({date}, ...) filled in once per flow run: from the flow run's
    scheduled time the first time, stored as {storage.root}/_flow-runs/{flow run id}.json and
    read back by every retry of that flow run, which so resumes the same run folder (a retry
    after midnight included). With `log` None nothing is written (the flow-run name)."""
    if not cfg.run_name or not is_template(cfg.run_name):
        return cfg
    fid = flow_run.id
    store, rel = RunRoot(cfg.storage_url), f"{FLOW_RUNS}/{fid}.json"
    if fid and store.exists(rel):
        record = store.read_json(rel)
        if record.get("template") == cfg.run_name:
            check_run_name(record["run_name"], f"run_name in {store.uri(rel)}")
            return dataclasses.replace(cfg, run_name=record["run_name"])
    when = flow_run.scheduled_start_time
    filled = cfg.with_run_name(when)
    if log is not None and fid:
        store.write_json(
            rel,
            {"run_name": filled.run_name, "template": cfg.run_name, "scheduled": str(when), "flow_run_id": str(fid)},
        )
        log.info("run_name %r is %r for this flow run (scheduled %s)", cfg.run_name, filled.run_name, when)
    return filled


# The names a flow run gets when nobody typed one: the UI's Run Name suggestions (the V2 UI's
# "Rustic-Koala": one of these adjectives; the V1 UI's "alpha3-andromedae-...": a Greek letter)
# and the server's coolname slug ("masterful-beetle", two words of coolname's lists).
_UI_ADJECTIVES = (
    "Awesome|Rustic|Small|Gorgeous|Fantastic|Sleek|Intelligent|Unbranded|Refined|Licensed|Generic|Practical|"
    "Ergonomic|Handcrafted|Tasty|Handmade|Incredible"
)
_SUGGESTED = re.compile(
    rf"(({_UI_ADJECTIVES})-[A-Z][A-Za-z' ]*)|((alpha|beta|gamma|delta|epsilon|zeta|eta|theta|iota|kappa|lambda|mu|nu|"
    r"xi|omicron|pi|rho|sigma|tau|upsilon|phi|chi|psi|omega)\d*-[a-z]+(-[a-z]+)?)"
)


@functools.lru_cache(maxsize=1)
def _slug_words() -> frozenset[str]:
    folder = os.path.join(os.path.dirname(coolname.__file__), "data")
    words: set[str] = set()
    for f in os.listdir(folder):
        if f.endswith(".txt"):
            with open(os.path.join(folder, f), encoding="utf-8") as fh:
                words.update(w for line in fh if not line.startswith("#") for w in re.findall(r"[a-z]+", line))
    return frozenset(words)


def typed_name(name: str | None) -> bool:
    """Whether a flow run's name is one a user typed (the UI's Run Name, the API's name) rather than
    one Prefect made up for it: a typed name is kept, a made-up one becomes the run folder's."""
    if not name or _SUGGESTED.fullmatch(name):
        return False
    words = name.split("-")
    return not (len(words) == 2 and all(w in _slug_words() for w in words))


def _run_named(prefix: str = "", config_of: Any = None):
    """A flow_run_name: the run's folder name (run_name, or preset and config hash), so the UI's
    list says which run each flow run is; Prefect's random pair of words where it cannot tell. A
    name the user typed (the UI's Run Name, run_deployment's flow_run_name) is kept. `config_of`:
    the flow's parameters -> its RunConfig (default: the full form's `config`). The name reads the
    sources (their versions, a model's config.json, the data's first row): in a deployment run it
    does so only for a config the trust policy allows, which `_allowed` checks again in the flow."""

    def name() -> str:
        if typed_name(flow_run.name):
            return flow_run.name
        params = flow_run.parameters or {}
        try:
            if "run_url" in params:  # grpo-evaluate: the run folder it reads (its name only: nothing is read)
                return prefix + str(params["run_url"]).rstrip("/").rsplit("/", 1)[-1]
            cfg = config_of(params) if config_of else _config(params.get("config"))
            if deployment.id is not None:  # as _allowed, before anything is read: refused, the flow says why
                cfg = allowed_config(lambda: cfg, _job_variables(None))
            return prefix + _resolve_for_name(_fill_run_name(cfg)).name
        except Exception:  # noqa: BLE001 - a bad config fails in the flow itself, with its message
            return prefix + "invalid-config"

    return name


# A flow run's config as its name resolved it: Prefect computes the name first, in the process
# that then runs the body, so the body takes that resolution instead of reading the sources again
# (one resolution per flow run: its name and its run folder agree by construction). By flow run id;
# the body takes it out (a retry of the flow run resolves anew).
_RESOLVED_FOR_NAME: dict[str, tuple[str, RunConfig, list[str]]] = {}


def _same(cfg: RunConfig) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True, default=str)


def _resolve_for_name(cfg: RunConfig) -> RunConfig:
    said: list[str] = []
    resolved = resolve_run(cfg, warn=said.append)
    if flow_run.id is not None:
        _RESOLVED_FOR_NAME[str(flow_run.id)] = (_same(cfg), resolved, said)
    return resolved


def _resolve_in_body(cfg: RunConfig, log: Any) -> RunConfig:
    """`cfg` resolved (grpo_core.resolve.resolve_run) once for this flow run: as its name resolved
    it where that was this very config, its warnings said now, in the run's log."""
    named = _RESOLVED_FOR_NAME.pop(str(flow_run.id), None)
    if named is None or named[0] != _same(cfg):
        return resolve_run(cfg, warn=log.warning)
    for warning in named[2]:
        log.warning("%s", warning)
    return named[1]


@flow(name="grpo-pipeline", retries=1, retry_delay_seconds=5, flow_run_name=_run_named())
def grpo_pipeline(config: RunParams = RunParams()) -> dict[str, Any]:
    """Run GRPO end to end: prepare the data, check readiness, train in epochs (each resumable
    from its last checkpoint), evaluate each epoch's checkpoint, and write summary.json.

    Args:
        config: The run: steps and epochs first, then the data, model and rewards, then the
            advanced sections, the storage root last. A field left empty takes the default for
            this config, as on the command line; the same config resumes its own run.
    """
    log = get_run_logger()
    try:
        cfg = _allowed(lambda: _config(config), log)  # before anything runs or is written
        return run_pipeline(cfg, log)
    except Refused as refused:
        return refused.state


def run_pipeline(cfg: RunConfig, log: Any) -> dict[str, Any]:
    """The pipeline of a config `_allowed` passed: the body of both deployments' flows (the full
    form's grpo_pipeline and the everyday form's flows.everyday.grpo_train)."""
    _set_flow_retries(log, cfg.pipeline.flow_retries)  # the form's value, not the decorator's
    # Seconds, not minutes of gcsfs retries, when a gs:// root has no network: the lease's first
    # read is the run's first storage call (StorageError naming storage.root and the cause).
    check_reachable(cfg.storage_url)
    cfg = _fill_run_name(cfg, log)  # a run_name template: the same folder for every retry of this flow run
    # the sources' current versions (a file rewritten in place is new data: a new run under
    # run_name: null, a refusal naming what changed under a fixed run_name)
    cfg = _resolve_in_body(cfg, log)
    # The run root's owner (grpo_core.store.lease): a second run of it is refused, not run beside this one.
    lease = RunLease(cfg.run_url, ttl_s=cfg.pipeline.lease_ttl_s, flow_run_id=flow_run.id, logger=log)
    try:
        return _pipeline(cfg, log, lease)
    except RunRootInUse:  # another run owns the run root: the flow fails the same way until it ends
        _no_flow_retry(log)
        raise
    finally:
        drop_ahead(ahead_scope())  # a next stage's worker started ahead that no stage took
        lease.release()  # deletes it only while it is still this run's


def _pipeline(cfg: RunConfig, log: Any, lease: RunLease) -> dict[str, Any]:
    opts = dict(
        retries=cfg.pipeline.retries, retry_delay_seconds=cfg.pipeline.retry_delay_s, retry_condition_fn=retryable
    )
    t0 = time.perf_counter()
    lease.raise_if_held()  # reads only: a refused run writes nothing (no config.json) into the other's root
    try:
        # reads only: a run folder that holds another config's run (an edited reward file, new data
        # under a fixed run_name) is refused before any task, naming what differs
        check_run_root(cfg)
    except ConfigError as exc:
        _no_flow_retry(log)
        raise _refusal(exc, log) from None
    try:
        run_url = init_run.with_options(**opts)(cfg.to_dict())
    except BaseException as exc:  # a reward that cannot load, another config's root, a damaged config.json
        if not can_retry(exc):
            _no_flow_retry(log)
        raise
    lease.acquire()  # the run root is this run's until the flow ends; the heartbeat keeps it so
    for path in remove_stale_temp(RunRoot(run_url)):  # what killed or failed writes of earlier attempts left
        log.info("removed a stale temporary file: %s", path)
    # Where the wall time goes: steps (the first step of each worker includes its compilation),
    # evaluation compute, and the eval tasks' wall time (process start, model build, compile).
    timing: dict[str, float] = {"train_steps_s": 0.0, "first_steps_s": 0.0, "eval_compute_s": 0.0, "eval_task_s": 0.0}
    worked = [False]  # whether this invocation trained, evaluated or exported anything

    def invocation() -> dict[str, Any]:
        return {"timing": dict(timing, wall_s=time.perf_counter() - t0), "did_work": worked[0]}

    try:
        prepare_dataset.with_options(**opts)(run_url)
        lease.check()  # between stages: LeaseLost once another run took the run root over
        check_readiness.with_options(**opts)(run_url)
        for epoch in range(cfg.pipeline.epochs):
            lease.check()
            steps = [0, cfg.epoch_end(epoch)] if epoch == 0 else [cfg.epoch_end(epoch)]
            last = epoch == cfg.pipeline.epochs - 1
            # The training worker goes on to evaluate the epoch (and, the last, to export) in its
            # own process: the evaluate and export tasks below read that back, and start a worker
            # of their own only for what it could not do (or did not: a failed follow-up).
            info = train_epoch.with_options(**opts)(run_url, epoch, steps, last and cfg.pipeline.export)
            if not info.get("skipped"):
                worked[0] = True
                for k in ("train_steps_s", "first_steps_s"):
                    timing[k] += info.get(k, 0.0)
            timing["eval_compute_s"] += info.get("eval_compute_s", 0.0)
            lease.check()
            t = time.perf_counter()
            ev = evaluate.with_options(**opts)(run_url, [0, info["step"]] if epoch == 0 else [info["step"]])
            timing["eval_task_s"] += time.perf_counter() - t
            timing["eval_compute_s"] += ev["eval_compute_s"]
            worked[0] = worked[0] or ev["eval_compute_s"] > 0
        if cfg.pipeline.export:
            lease.check()
            worked[0] = not export_model.with_options(**opts)(run_url, info["step"])["cached"] or worked[0]
    except BaseException as exc:
        # Ctrl-C (RunInterrupted, KeyboardInterrupt) or SIGTERM, which Prefect's engine turns into
        # TerminationSignal while a flow runs (its workers were stopped gracefully on the way out)
        status = "interrupted" if isinstance(exc, (KeyboardInterrupt, TerminationSignal)) else "failed"
        if not isinstance(exc, RunRootInUse):  # the run root is another run's now: write nothing there
            worked[0] = True  # a failed or interrupted attempt took its time: it counts
            try:
                summarize(run_url, status, {"error": _error_text(exc)}, invocation())
            except Exception as summary_exc:  # noqa: BLE001 - a damaged or unwritable run root: the cause above counts
                log.warning("no summary of this attempt: %s: %s", type(summary_exc).__name__, summary_exc)
        if isinstance(exc, TerminationSignal):  # a cancel (INFO) or another SIGTERM (WARNING), not an error
            log.log(stop_level(), "run interrupted: %s", _error_text(exc))
        else:
            log.error("run %s: %s", status, "".join(traceback.format_exception_only(exc)).strip())
        if not can_retry(exc):
            _no_flow_retry(log)
        raise
    lease.check()
    summary = summarize(run_url, "completed", {}, invocation())
    log.info("run complete: %s", run_url)
    return summary


@flow(name="grpo-evaluate", flow_run_name=_run_named("evaluate-"))
def grpo_evaluate(run_url: str, steps: Optional[list[int]] = None) -> dict[str, Any]:
    """Evaluate checkpoints of an existing run (0: the starting policy) into {run}/eval/.

    Args:
        run_url: The run's folder: storage.root/run_name, e.g. gs://bucket/grpo-runs/tiny-ecc6c5c9
            or /data/runs/my-run (`grpo status` and the summary artifact print it).
        steps: Checkpoint steps to evaluate; 0 is the starting policy. Empty: the newest
            finalised checkpoint (what a nightly evaluation of a run in progress wants). Each
            result lands in {run_url}/eval/{step}.json; a step already evaluated is read back.
    """
    try:
        cfg = _allowed(lambda: load_run(run_url), get_run_logger(), run_url=run_url)
    except Refused as refused:
        return refused.state
    if not steps:
        found = checkpoint_steps(RunRoot(run_url))
        steps = [found[-1] if found else 0]
        get_run_logger().info(
            "steps empty: evaluating the newest finalised checkpoint, step %d%s",
            steps[0],
            "" if found else " (no checkpoint yet: the starting policy)",
        )
    opts = dict(
        retries=cfg.pipeline.retries, retry_delay_seconds=cfg.pipeline.retry_delay_s, retry_condition_fn=retryable
    )
    return evaluate.with_options(**opts)(run_url, steps)


@flow(name="grpo-readiness", flow_run_name=_run_named("readiness-"))
def grpo_readiness(config: RunParams = RunParams()) -> dict[str, Any]:
    """The readiness report alone (storage probe, devices, memory budget), as an artifact.

    Args:
        config: The run to check, as for the pipeline: its storage root is probed and its
            memory plan checked on this worker's devices. Empty fields: the config's defaults.
    """
    try:
        cfg = _allowed(lambda: _config(config), get_run_logger())  # before anything runs, is read or written
    except Refused as refused:
        return refused.state
    return readiness_run(cfg)


def readiness_run(cfg: RunConfig) -> dict[str, Any] | State:
    """A readiness run's work for an allowed config (grpo-readiness/readiness, grpo-readiness/check):
    the report as an artifact; a run not ready ends Failed with one log line, its reasons. The
    config is resolved as the pipeline's run of it would resolve it (grpo_core.resolve: its run
    folder, rewards and num_steps are the run's), as `grpo check` does."""
    log = get_run_logger()
    try:
        cfg = _resolve_in_body(_fill_run_name(cfg), log)
    except (ConfigError, StorageError) as exc:  # what the run would refuse before any task: its answer
        log.error("not ready: %s: %s", type(exc).__name__, exc)
        return Failed(message=f"not ready: {type(exc).__name__}: {exc}")
    report = readiness_report(cfg, data=True)
    try:
        publish_readiness(report, cfg.name)
    except StageError as exc:  # an answer, not a crash: one line in the log, the state holds it
        log.error("%s", exc)
        return Failed(message=str(exc))
    return {k: report.get(k) for k in ("ready", "backend", "device_kind", "device_count", "process_count")}
