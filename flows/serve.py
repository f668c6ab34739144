"""The deployments `grpo serve` serves against a Prefect server: the full pipeline, evaluation
of a checkpoint, and readiness alone (grpo-pipeline/pipeline, grpo-evaluate/evaluate,
grpo-readiness/readiness). Served deployments run in this process's runner. The work-pool
deployments in deployments/*.yaml run the same flows under other names (`pool`, `pool-nightly`,
`gke-tpu`, `vertex`), so `prefect deploy` and `grpo serve` never overwrite each other.

Parameters are the typed RunParams, so the UI shows a form and the server rejects invalid
values before a run starts (enforce_parameter_schema). The pipeline deployment runs one flow
run at a time (concurrency_limit=1): two runs never share one accelerator.

Ownership: each `grpo serve` writes its own token into its deployments' `version`. When it
stops it pauses only the deployments whose version is still its token, so stopping an older
`grpo serve` leaves a newer one's schedules running.

`require_project_dir` is the first pull step of the work-pool deployments: it moves the flow
run into GRPO_PROJECT_DIR, or fails the run with a message saying what to set.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import uuid
from typing import Any

FLOW_ENTRYPOINT = os.path.join("flows", "pipeline.py")


def build_deployments(
    parameters: dict[str, Any] | None = None,
    cron: str | None = None,
    interval: float | None = None,
    version: str | None = None,
) -> list:
    from flows.pipeline import grpo_evaluate, grpo_pipeline, grpo_readiness

    schedule = {"cron": cron} if cron else {"interval": interval} if interval else {}
    params = {"config": parameters} if parameters else {}
    return [
        grpo_pipeline.to_deployment(
            name="pipeline",
            parameters=params,
            enforce_parameter_schema=True,
            concurrency_limit=1,
            tags=["grpo"],
            description="GRPO end to end: data -> readiness -> training epochs -> evaluation -> summary",
            version=version,
            **schedule,
        ),
        grpo_evaluate.to_deployment(
            name="evaluate",
            enforce_parameter_schema=True,
            concurrency_limit=1,
            tags=["grpo"],
            description="Evaluate checkpoints of a run",
            version=version,
        ),
        grpo_readiness.to_deployment(
            name="readiness",
            enforce_parameter_schema=True,
            tags=["grpo"],
            description="Preflight checks alone",
            version=version,
        ),
    ]


def allow_code(
    paths: list[str], modules: list[str], fields: list[str], parameters: dict[str, Any] | None = None
) -> None:
    """What the served deployments' runs may name besides the built-in rewards, set in this
    process's environment, which the flow runs it starts inherit (grpo_core.rewards.trust): the
    reward folders and modules and the program fields given, added to those already set, and
    the reward files and modules of the operator's own config (`parameters`, from --config/--set)."""
    from grpo_core.rewards.registry import builtin_rewards
    from grpo_core.rewards.trust import ENV_FIELDS, ENV_MODULES, ENV_PATHS, PROGRAM_FIELDS, TrustPolicy

    unknown = [f for f in fields if f not in PROGRAM_FIELDS]
    if unknown:
        raise ValueError(f"--allow-field {unknown[0]!r} is not one of {', '.join(PROGRAM_FIELDS)}")
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
    os.environ[ENV_PATHS] = os.pathsep.join(dict.fromkeys(paths))
    os.environ[ENV_MODULES] = ",".join(dict.fromkeys(modules))
    os.environ[ENV_FIELDS] = ",".join(dict.fromkeys([*policy.fields, *fields]))


def owner_token() -> str:
    """This process's mark on the deployments it serves (their `version`)."""
    return f"grpo-serve {socket.gethostname()} pid {os.getpid()} {uuid.uuid4().hex[:8]}"


def serve(
    parameters: dict[str, Any] | None = None, cron: str | None = None, interval: float | None = None, limit: int = 1
) -> None:
    """Serve until interrupted. `limit` bounds concurrent flow runs of this process. On the way
    out, pause the deployments this process still owns (not those a newer `grpo serve` took)."""
    from prefect import serve as prefect_serve

    token = owner_token()
    deployments = build_deployments(parameters, cron, interval, version=token)
    if threading.current_thread() is threading.main_thread():
        # until Prefect's runner installs its own handler (after registering the deployments), a
        # SIGTERM would end this process without the pausing below
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        _report_replaced(deployments)
        prefect_serve(*deployments, limit=limit, pause_on_shutdown=False)
    finally:
        try:
            _pause_owned(deployments, token)
        except Exception as exc:  # noqa: BLE001 - the server is gone: nothing to pause there
            print(f"grpo serve: could not pause its deployments on the way out: {exc}", file=sys.stderr)


def _exit_on_sigterm(signum, frame) -> None:
    sys.exit(0)  # as Prefect's runner does on SIGTERM


def _full_name(deployment) -> str:
    return f"{deployment.flow_name}/{deployment.name}"


def _report_replaced(deployments: list) -> None:
    """Say so when serving replaces a deployment that `prefect deploy` put on a work pool (the
    names in an older deployments/prefect.yaml were the same as these)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

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


def _pause_owned(deployments: list, token: str) -> None:
    """Pause each deployment whose version is still `token`. If another `grpo serve` takes one
    over while it is being paused, resume it: its new owner serves it unpaused."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for d in deployments:
            try:
                current = client.read_deployment_by_name(_full_name(d))
                if current.version != token:
                    continue
                client.pause_deployment(current.id)
                if client.read_deployment(current.id).version != token:
                    client.resume_deployment(current.id)
            except ObjectNotFound:
                continue


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
    import logging

    from prefect.client.orchestration import get_client
    from prefect.logging import get_logger
    from prefect.states import Failed

    # the worker's process that runs pull steps sends this to the API before it exits
    get_logger("prefect.flow_runs").log(logging.ERROR, message, extra={"flow_run_id": run_id})
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, Failed(message=message))
