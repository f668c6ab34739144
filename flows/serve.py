"""The deployments `grpo serve` serves against a Prefect server: the pipeline's everyday form and
its full form, evaluation of a checkpoint, and readiness alone in the same two forms
(grpo-pipeline/train, grpo-pipeline/pipeline, grpo-evaluate/evaluate, grpo-readiness/check,
grpo-readiness/readiness). Served deployments run
in this process's runner. The work-pool
deployments in deployments/*.yaml run the same flows under other names (`pool`, `pool-nightly`,
`gke-tpu`, `vertex`), so `prefect deploy` and `grpo serve` never overwrite each other.

Parameters are typed (RunParams; the everyday form's dozen fields, flows.everyday), so the UI
shows a form and the server rejects invalid values before a run starts (enforce_parameter_schema).
Each pipeline deployment runs one flow run at a time (concurrency_limit=1), and `grpo serve` one
flow run of all of them (--limit, default 1): two runs never share one accelerator.

Ownership: the serving process owns its deployments (flows.serve_runner). Each `grpo serve`
writes its own token into their `version`; a second one registering them says whose they were,
and the first one notices at its next poll, says who took over, stops its flow runs as a SIGTERM
does and exits. When one stops it pauses only the deployments whose version is still its token,
so a newer `grpo serve`'s schedules keep running. A flow run's code is always this process's own
(its entrypoint, never the pull steps, path or entrypoint of the deployment's record on the
server), a run whose deployment's record changed since it was registered fails before anything
of it runs, and registering sets every field of that record again.

`require_project_dir` is the first pull step of the work-pool deployments: it moves the flow
run into GRPO_PROJECT_DIR, or fails the run with a message saying what to set.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound, TerminationSignal
from prefect.logging import get_logger
from prefect.states import Cancelled, Crashed, Failed
from pydantic.fields import FieldInfo

from flows.everyday import EVERYDAY, everyday_config, everyday_defaults, grpo_check, grpo_train
from flows.logs import private_folder, quiet_logging_config, stop_file, write_private
from flows.pipeline import (
    _config,
    allowed_config,
    grpo_evaluate,
    grpo_pipeline,
    grpo_readiness,
    job_variables_of,
)
from flows.serve_runner import ServeRunner
from grpo_core.errors import ConfigError
from grpo_core.rewards.registry import builtin_rewards
from grpo_core.rewards.trust import (
    ENV_FIELDS,
    ENV_HOSTS,
    ENV_LIMITS,
    ENV_MODULES,
    ENV_PATHS,
    ENV_ROOTS,
    Trust,
    TrustPolicy,
    check_allowed_fields,
    fields_of,
    parse_limits,
    place_values,
    value_of,
)
from tasks.stages import load_run

FLOW_ENTRYPOINT = os.path.join("flows", "pipeline.py")
# each served deployment (build_deployments) by name: the flow its runs run, whatever the server says
SERVED_FLOWS = {
    "train": grpo_train,
    "pipeline": grpo_pipeline,
    "evaluate": grpo_evaluate,
    "check": grpo_check,
    "readiness": grpo_readiness,
}
# and as the server names them, flow/deployment: grpo-pipeline/train, ...
SERVED_NAMES = tuple(f"{served.name}/{name}" for name, served in SERVED_FLOWS.items())


def _asks(name: str, args: dict[str, Any]) -> tuple[Any, str | None]:
    """What a served flow's arguments ask for, as its body reads them: the maker of the config it
    runs and, for grpo-evaluate, the run folder it reads (flows.pipeline._allowed's arguments)."""
    if name in ("train", "check"):
        return (lambda: everyday_config({k: args[k] for k in EVERYDAY})), None
    if name == "evaluate":
        return (lambda: load_run(args["run_url"])), args["run_url"]
    return (lambda: _config(args["config"])), None


def refusal(name: str, flow_run: Any, record: Any) -> str | None:
    """Why the flow of the served deployment `name` would refuse `flow_run` (its trust check,
    flows.pipeline.allowed_config, on its parameters and the job variables of the run and of the
    deployment's `record`), said by grpo serve before the run's process starts: no process for a
    refused run. None where it would not refuse, or where something else stops it first (the
    engine's own validation of the parameters): the flow meets that and says so as ever."""
    flow = SERVED_FLOWS[name]
    try:
        bound = inspect.signature(flow.fn).bind(**flow.validate_parameters(dict(flow_run.parameters or {})))
        bound.apply_defaults()
        # a default given as pydantic's Field (the everyday form's): its value, as the engine's call takes it
        args = {
            k: v.get_default(call_default_factory=True) if isinstance(v, FieldInfo) else v
            for k, v in bound.arguments.items()
        }
        make_config, run_url = _asks(name, args)
    except Exception:  # noqa: BLE001 - the engine validates them again, and fails the run saying why
        return None
    try:
        allowed_config(make_config, job_variables_of(record, flow_run), run_url)
    except ConfigError as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - not a refusal: the flow meets it and says so
        return None
    return None


def build_deployments(
    parameters: dict[str, Any] | None = None,
    cron: str | None = None,
    interval: float | None = None,
    version: str | None = None,
) -> list:
    schedule = {"cron": cron} if cron else {"interval": interval} if interval else {}
    params = {"config": parameters} if parameters else {}
    # the everyday form (flows.everyday): the served config's values of its fields are its defaults
    everyday, rest = everyday_defaults(parameters)
    # what every served deployment is: its form checked by the server, tagged, marked with this serve's
    # token; one run at a time where a run takes the accelerator (readiness's checks do not train)
    common = dict(enforce_parameter_schema=True, tags=["grpo"], version=version)
    one_at_a_time = dict(common, concurrency_limit=1)
    full = (
        "The full form, for experts: every key of the config, the keys grpo run --set takes (and the API's config "
        "parameter), each section's fields before its advanced subsections; the same pipeline as "
        "grpo-pipeline/train, whose form has only the fields most runs set."
    )
    return [
        grpo_train.to_deployment(
            name="train", parameters=everyday, description=everyday_description(rest), **one_at_a_time
        ),
        grpo_pipeline.to_deployment(
            name="pipeline",
            parameters=params,
            description=full + (" Scheduled by grpo serve (its --cron or --interval)." if schedule else ""),
            **one_at_a_time,
            **schedule,
        ),
        grpo_evaluate.to_deployment(
            name="evaluate",
            description="Evaluate checkpoints of an existing run: run_url is its folder (storage root and run "
            "folder), steps the checkpoints (0: the starting policy; empty: the newest). Results land in the "
            "run's eval folder and its evaluation table artifact.",
            **one_at_a_time,
        ),
        grpo_check.to_deployment(
            name="check",
            parameters=everyday,
            description="Preflight checks alone, nothing trained, for the run grpo-pipeline/train's form starts "
            "with the same fields: the storage root probed, the data read, this worker's devices and the memory "
            "plan, as the readiness artifact. Every other key: grpo-readiness/readiness.",
            **common,
        ),
        grpo_readiness.to_deployment(
            name="readiness",
            description="Preflight checks alone, nothing trained: the config's storage root probed, this "
            "worker's devices and the config's memory plan, as the readiness artifact. Its form is the full "
            "one, as grpo-pipeline/pipeline's; grpo-readiness/check's has the everyday fields.",
            **common,
        ),
    ]


def everyday_description(rest: list[str]) -> str:
    """grpo-pipeline/train's description; `rest`: the served config's keys its form has no field for."""
    text = (
        "The everyday run: GRPO end to end (data, readiness, training epochs, evaluation, export, summary) "
        "from the fields most runs set: data source, model path or preset, rewards, steps and epochs, run "
        "folder, tools, learning rate, new tokens per completion, LoRA on or off, storage root. Each field "
        "says its default; an "
        "empty field is the default for this config. Every other key of the config: grpo-pipeline/pipeline."
    )
    if rest:
        text += (
            f" Served with keys this form has no field for ({', '.join(rest)}): its runs take their defaults, "
            "grpo-pipeline/pipeline's runs take them as served."
        )
    return text


def allow_code(
    paths: list[str],
    modules: list[str],
    fields: list[str],
    parameters: dict[str, Any] | None = None,
    roots: list[str] | None = None,
    hosts: list[str] | None = None,
    limits: list[str] | None = None,
) -> None:
    """What the served deployments' runs may name, set in this process's environment at start,
    which the flow runs it starts inherit (grpo_core.rewards.trust): the reward folders and
    modules, program and address fields, roots, hosts and limits on work given, added to those
    already set, and what the operator's own config (`parameters`, from --config/--set) names:
    its reward files and modules, its places (storage.root, the data, the model: the deployments'
    runs may write and read there) and its addresses. Read once, here: nothing a caller of the
    API sets later (a deployment's parameters, a PATCH of them) changes it."""
    try:
        check_allowed_fields(tuple(fields), "--allow-field")
        parse_limits(limits or [], "--raise-limit")
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    policy = TrustPolicy.from_env()  # what is allowed already (the default reward folder included)
    params = parameters or {}
    evals = params.get("eval") if isinstance(params.get("eval"), dict) else {}
    specs = [
        s.get("function") if isinstance(s, dict) else s for s in [*params.get("rewards", []), *evals.get("rewards", [])]
    ]
    specs = [s for s in specs if isinstance(s, str) and ":" in s and s not in builtin_rewards()]
    files = [s.rsplit(":", 1)[0] for s in specs if s.rsplit(":", 1)[0].endswith(".py")]
    paths = [*policy.reward_paths, *(os.path.abspath(p) for p in paths), *files]
    modules = [*policy.reward_modules, *modules, *(s for s in specs if not s.rsplit(":", 1)[0].endswith(".py"))]
    own_places: list[str] = []
    own_fields: list[str] = []
    if parameters:
        try:
            own = _config(params)  # as its runs read their parameters (the form's: flows.params.RunParams)
        except ConfigError as exc:
            raise ValueError(f"the config to serve: {exc}") from None
        for field, value in place_values(own, Trust.READS, Trust.WRITES):  # reward models' folders too
            if value and policy.place_refusal(field, value) is not None:  # a place, not allowed yet
                own_places.append(value.split("@")[0] if field == "model.init_from" else value)
        default = _config({})  # built once: the fields' defaults, as a run's empty form reads
        own_fields = [  # the programs and addresses it names itself
            f
            for f in fields_of(Trust.PROGRAM, Trust.ADDRESS)
            if f not in policy.fields and value_of(own, f) != value_of(default, f)
        ]
    os.environ[ENV_PATHS] = os.pathsep.join(dict.fromkeys(paths))
    os.environ[ENV_MODULES] = ",".join(dict.fromkeys(modules))
    os.environ[ENV_FIELDS] = ",".join(dict.fromkeys([*policy.fields, *fields, *own_fields]))
    given = [r if "://" in r else os.path.abspath(os.path.expanduser(r)) for r in [*(roots or []), *own_places]]
    if any("," in r for r in given):
        raise ValueError(f"--allow-root {next(r for r in given if ',' in r)!r}: a root may not contain ','")
    os.environ[ENV_ROOTS] = ",".join(dict.fromkeys([*policy.roots, *given]))
    os.environ[ENV_HOSTS] = ",".join(dict.fromkeys([*policy.hosts, *(h.lower() for h in hosts or [])]))
    os.environ[ENV_LIMITS] = ",".join([*(f"{k}={v:g}" for k, v in policy.limits), *(limits or [])])


def owner_token() -> str:
    """This process's mark on the deployments it serves (their `version`)."""
    return f"grpo-serve {socket.gethostname()} pid {os.getpid()} {uuid.uuid4().hex[:8]}"


def serve(
    parameters: dict[str, Any] | None = None, cron: str | None = None, interval: float | None = None, limit: int = 1
) -> None:
    """Serve until interrupted or taken over. `limit` bounds concurrent flow runs of this process.
    On the way out (SIGTERM, SIGINT, another `grpo serve` taking the deployments over), stop the
    flow runs this process runs as a cancel does and mark them in the API (stop_flow_runs), then
    pause the deployments this process still owns (not those a newer `grpo serve` took). On the
    way in, mark the runs a `grpo serve` that died left as Running (mark_orphaned_runs), say whose
    deployments it takes over, and register every field of the deployments' records it relies on
    (flows.serve_runner)."""

    class _Runner(ServeRunner):
        def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:  # Prefect's runner installs it
            _on_stop_signal(signal.SIGTERM, None)

    token = owner_token()
    deployments = build_deployments(parameters, cron, interval, version=token)
    private = private_folder()  # stop reasons and the logging config: 0700, removed on the way out
    # the flow-run processes this runner starts log through Prefect's config plus flows.logs' filter
    logging_config = quiet_logging_config()
    if logging_config:
        os.environ["PREFECT_LOGGING_SETTINGS_PATH"] = logging_config
    if threading.current_thread() is threading.main_thread():
        # until Prefect's runner installs its own handler (after registering the deployments), a
        # SIGTERM would end this process without the pausing below
        signal.signal(signal.SIGTERM, _on_stop_signal)
        signal.signal(signal.SIGINT, _on_stop_signal)  # asyncio keeps a handler it did not install
    try:
        _report_replaced(deployments)
        _report_taken_over(deployments, token)
        try:
            mark_orphaned_runs(deployments)
        except Exception as exc:  # noqa: BLE001 - serving matters more than tidying up after another
            print(f"grpo serve: could not check for runs a stopped grpo serve left: {exc}", file=sys.stderr)
        runner = _Runner(token, _on_taken_over, pause_on_shutdown=False, limit=limit)
        for d in deployments:
            runner.serve_deployment(d, SERVED_FLOWS[d.name], functools.partial(refusal, d.name))
        print(f"grpo serve: serving {', '.join(_full_name(d) for d in deployments)} (pid {os.getpid()})", flush=True)
        rest = everyday_defaults(parameters)[1]
        if rest:
            print(
                f"grpo serve: grpo-pipeline/train has no field for {', '.join(rest)}: its runs take those keys' "
                "defaults (grpo-pipeline/pipeline's runs take them as given here)",
                file=sys.stderr,
            )
        try:
            asyncio.run(runner.start())
        except (KeyboardInterrupt, TerminationSignal, SystemExit):
            pass
    finally:
        try:
            paused = _pause_owned(deployments, token)
            if paused:  # what the UI then shows, said where the operator looks
                print(
                    f"grpo serve: paused {', '.join(paused)}: a served deployment runs only in the process "
                    "serving it, so until a grpo serve serves it again (which unpauses it) its schedule and "
                    "its Run button would make runs that nobody picks up",
                    file=sys.stderr,
                )
        except Exception as exc:  # noqa: BLE001 - the server is gone: nothing to pause there
            print(f"grpo serve: could not pause its deployments on the way out: {exc}", file=sys.stderr)
        shutil.rmtree(private, ignore_errors=True)  # the logging config and every stop file in it


def _serve_named(version: str) -> str:
    """Who a deployment's `version` says serves it (owner_token), for the lines below."""
    owner = version.split()
    if len(owner) == 5 and owner[0] == "grpo-serve" and owner[2] == "pid":
        return f"grpo serve pid {owner[3]} on {owner[1]} ({owner[4]})"
    return f"something else (its version reads {version!r})"


def _report_taken_over(deployments: list, token: str) -> None:
    """Say so when these deployments are another `grpo serve`'s: this one takes them over, and that
    one, if it still runs, notices at its next poll and exits (ServeRunner, _on_taken_over)."""
    owners: dict[str, list[str]] = {}
    host = socket.gethostname()
    with get_client(sync_client=True) as client:
        for d in deployments:
            try:
                version = client.read_deployment_by_name(_full_name(d)).version or ""
            except ObjectNotFound:
                continue
            if version.startswith("grpo-serve ") and version != token:
                owners.setdefault(version, []).append(_full_name(d))
    for version, names in owners.items():
        owner = version.split()
        gone = len(owner) == 5 and owner[1] == host and owner[3].isdigit() and not _alive(int(owner[3]))
        print(
            f"grpo serve: taking over {', '.join(names)} from {_serve_named(version)}"
            + (
                ", which is no longer running"
                if gone
                else ": if it still runs, it stops picking up flow runs at its next poll, stops the ones it runs "
                "as a SIGTERM of it does, and exits"
            ),
            file=sys.stderr,
            flush=True,
        )


def _on_taken_over(names: list[str], version: str) -> None:
    """Another `grpo serve` registered `names` (their version is now `version`): say so, stop this
    process's flow runs as a SIGTERM of it does, and exit. Stopped rather than left to finish: the
    serve that took over may start runs at once, and this process's --limit is what keeps two runs
    off one accelerator; a stopped run keeps its checkpoint and resumes with the UI's Retry."""
    print(
        f"grpo serve: {', '.join(names)} taken over by {_serve_named(version)}: this grpo serve (pid {os.getpid()}) "
        "picks up no more flow runs, stops the ones it runs and exits",
        file=sys.stderr,
        flush=True,
    )
    if _STOPPING:  # a stop signal came first
        return
    _STOPPING.append(0)  # a stop signal from now on exits at once
    try:
        stop_flow_runs(f"grpo serve (pid {os.getpid()}) was taken over by {_serve_named(version)}")
    except Exception as exc:  # noqa: BLE001 - exit anyway
        print(f"grpo serve: could not stop its flow runs: {exc}", file=sys.stderr)
    asyncio.get_running_loop().call_soon(_exit_the_loop)


_STOPPING: list[int] = []


def _on_stop_signal(signum, frame) -> None:
    """SIGTERM or SIGINT: stop this process's flow runs as a cancel does, then exit (a second
    signal exits at once). Without it the runner exited and its flow runs were killed with no
    checkpoint or summary, their leases left and the API showing them Running, holding the
    deployment's concurrency slot until someone cancelled them by hand."""
    if _STOPPING:
        raise SystemExit(128 + signum)
    _STOPPING.append(signum)
    name = signal.Signals(signum).name
    try:
        stop_flow_runs(f"grpo serve (pid {os.getpid()}) was stopped by {name}")
    except Exception as exc:  # noqa: BLE001 - exit anyway
        print(f"grpo serve: could not stop its flow runs: {exc}", file=sys.stderr)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # before or after the runner's loop: nothing half-done to interrupt
        raise SystemExit(0) from None
    # Inside the loop the signal interrupted whatever code was running, e.g. anyio's hand-off of a
    # write to its worker thread halfway through: raised there, SystemExit left that task waiting
    # forever and asyncio.run's shutdown waiting on it. Raised from a callback of its own, it
    # leaves the loop between two callbacks.
    loop.call_soon_threadsafe(_exit_the_loop)


def _exit_the_loop() -> None:
    raise SystemExit(0)


def _flow_run_children() -> dict[str, int]:
    """flow run id -> pid of each flow-run process this process started (the runner sets
    PREFECT__FLOW_RUN_ID in their environment)."""
    out, me = {}, os.getpid()
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != me:
                    continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if b"PREFECT__FLOW_RUN_ID" in env:
            out[env[b"PREFECT__FLOW_RUN_ID"].decode()] = int(name)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_flow_runs(message: str, grace_s: float = 60.0) -> list[str]:
    """SIGTERM each flow run this process runs, as a cancel does: the flow stops its training
    worker at a step boundary (an interrupted checkpoint), writes summary.json "interrupted"
    with `message`, releases the run root's lease and reports Crashed. After `grace_s` a run
    still going is killed. A run whose state is not final then is set Cancelled, so the
    deployment's concurrency slot frees. Returns the flow run ids it stopped."""
    runs = _flow_run_children()
    if not runs:
        return []
    for run_id, pid in runs.items():
        print(f"grpo serve: stopping flow run {run_id} (pid {pid}): {message}", file=sys.stderr, flush=True)
        _write_stop_reason(run_id, message)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while any(_alive(p) for p in runs.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in runs.values():
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _finalize(list(runs), message)
    return list(runs)


def _write_stop_reason(run_id: str, message: str) -> None:
    """Who stopped the run, for its summary.json and its log (flows.logs.stop_reason reads it)."""
    path = stop_file(run_id)
    if path is None:
        return
    try:
        write_private(path, message)
    except OSError:
        pass


def _finalize(run_ids: list[str], message: str) -> None:
    """Set each run that is not in a final state Cancelled (its process is gone)."""
    with get_client(sync_client=True) as client:
        for run_id in run_ids:
            try:
                run = client.read_flow_run(run_id)
                if run.state is None or not run.state.is_final():
                    client.set_flow_run_state(run_id, Cancelled(message=message), force=True)
            except Exception as exc:  # noqa: BLE001 - the others still
                print(f"grpo serve: could not mark flow run {run_id}: {exc}", file=sys.stderr)


def mark_orphaned_runs(deployments: list) -> list[str]:
    """Flow runs of these deployments that a `grpo serve` on this host started and that are
    still Running, Pending or Cancelling though that process is gone (kill -9, a crash of the
    machine): set Crashed, saying so, so the deployment's concurrency slot frees. The serving
    process is read from the run's deployment_version (owner_token). Returns their ids."""
    host, marked = socket.gethostname(), []
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING, StateType.CANCELLING])
                )
            ),
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[d.name for d in deployments])),
        )
        for run in runs:
            owner = (run.deployment_version or "").split()
            if len(owner) < 4 or owner[0] != "grpo-serve" or owner[1] != host or owner[2] != "pid":
                continue
            try:
                pid = int(owner[3])
            except ValueError:
                continue
            if pid == os.getpid() or _alive(pid):
                continue
            message = (
                f"the grpo serve that ran it (pid {pid} on {host}) is gone; marked by grpo serve pid {os.getpid()}"
            )
            client.set_flow_run_state(run.id, Crashed(message=message), force=True)
            print(f"grpo serve: flow run {run.name} ({run.id}) was left {run.state.name}: {message}", file=sys.stderr)
            marked.append(str(run.id))
    return marked


def _full_name(deployment) -> str:
    return f"{deployment.flow_name}/{deployment.name}"


def _report_replaced(deployments: list) -> None:
    """Say so when serving replaces a deployment that `prefect deploy` put on a work pool (the
    names in an older deployments/prefect.yaml were the same as these)."""
    with get_client(sync_client=True) as client:
        for d in deployments:
            try:
                existing = client.read_deployment_by_name(_full_name(d))
            except ObjectNotFound:
                continue
            if existing.work_pool_name:
                print(
                    f"grpo serve: {_full_name(d)} was a deployment of work pool {existing.work_pool_name!r}; "
                    "serving replaces its parameters and schedules, and a worker of that pool can still pick up "
                    f"its runs. Delete it first (prefect deployment delete {_full_name(d)}) and deploy the "
                    "work-pool deployments under their own names (deployments/README.md).",
                    file=sys.stderr,
                )


def _pause_owned(deployments: list, token: str) -> list[str]:
    """Pause each deployment whose version is still `token`. If another `grpo serve` takes one
    over while it is being paused, resume it: its new owner serves it unpaused. Returns the names
    of those left paused."""
    paused = []
    with get_client(sync_client=True) as client:
        for d in deployments:
            try:
                current = client.read_deployment_by_name(_full_name(d))
                if current.version != token:
                    continue
                client.pause_deployment(current.id)
                if client.read_deployment(current.id).version != token:
                    client.resume_deployment(current.id)
                else:
                    paused.append(_full_name(d))
            except ObjectNotFound:
                continue
    return paused


def require_project_dir() -> dict[str, str]:
    """Pull step (deployments/*.yaml): change into GRPO_PROJECT_DIR, the path of this repository on
    the worker's machine. Without it the flow run fails, with a message that says what to set, in
    its state and its logs."""
    project = os.environ.get("GRPO_PROJECT_DIR", "")
    if project and os.path.isfile(os.path.join(project, FLOW_ENTRYPOINT)):
        os.chdir(project)
        return {"directory": os.getcwd()}
    found = f"GRPO_PROJECT_DIR={project!r}, with no {FLOW_ENTRYPOINT} there" if project else "it is unset"
    message = (
        f"GRPO_PROJECT_DIR must name this repository where the flow runs ({found}): set it in the worker's "
        "environment, e.g. from the repository root: GRPO_PROJECT_DIR=$PWD prefect worker start --pool grpo-local "
        "(GKE, Vertex AI: job_variables.env in deployments/gke-tpu.yaml, deployments/vertex.yaml)"
    )
    _fail_flow_run(message)
    raise RuntimeError(message)


def _fail_flow_run(message: str) -> None:
    """Put `message` in the flow run's logs and state: a failing pull step alone shows only
    "Process exited with status code: 1" there, its error going to the worker's stderr."""
    run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
    if not run_id:
        return
    # the worker's process that runs pull steps sends this to the API before it exits
    get_logger("prefect.flow_runs").log(logging.ERROR, message, extra={"flow_run_id": run_id})
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, Failed(message=message))
