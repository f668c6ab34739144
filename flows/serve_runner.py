"""The runner `grpo serve` serves its deployments with: the serving process owns them.

Prefect's runner starts a served deployment's flow run as `python -m prefect.engine`, and the
engine takes the flow's code from the deployment's record on the server: it runs the record's
pull_steps, copies its `path` into the working directory and imports its `entrypoint`. Anyone who
can PATCH /api/deployments/{id} can change those, so ServeRunner never lets the record say what
runs:

- Each flow-run process starts with this process's own entrypoint (PREFECT__FLOW_ENTRYPOINT, the
  module of the flow it registered): the engine imports that, and reads no pull step, path or
  entrypoint from the server. The runner looks up cancel and crash hooks in the flows registered
  here too, never by loading the record's code into this process.
- Before a flow run starts, its deployment's record is compared with what this process registered
  (GUARDED: what Prefect acts on to load or run code, or to say where it runs). A difference fails
  the flow run, naming the fields, and starts nothing. The entrypoint above holds without this
  check (a PATCH can land between the check and the start); the check says so loudly.
- Then the flow run's parameters and job variables go through the flow's own trust check
  (flows.pipeline.allowed_config, with the policy of this process's environment): a run the flow
  would refuse is failed here with the flow's message and one log line, and no process starts for
  it. The flow checks again when it runs (as it does under a work-pool worker).
- Each poll for flow runs first checks that this process still owns its deployments (its token in
  their `version`): when another `grpo serve` registered them, this one polls no more and
  `on_taken_over` is called.

Default parameters, description, tags, schedules and concurrency are not compared: the trust policy
checks every run's parameters (grpo_core.rewards.trust), and the rest runs nothing.
"""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable
from uuid import UUID

import anyio
import anyio.abc
import anyio.to_thread
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import DeploymentUpdate
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.exceptions import ObjectNotFound
from prefect.logging.loggers import flow_run_logger
from prefect.runner import Runner
from prefect.runner._starter_engine import EngineCommandStarter
from prefect.states import Failed

# the record's fields Prefect acts on to load or run a flow run's code, or to send it elsewhere
GUARDED = (
    "pull_steps",
    "entrypoint",
    "path",
    "job_variables",
    "work_pool_name",
    "work_queue_name",
    "storage_document_id",
    "infrastructure_document_id",
    "parameter_openapi_schema",
    "enforce_parameter_schema",
)
_EMPTY = {"pull_steps": [], "job_variables": {}}  # the server reads back null as these


@dataclass(frozen=True)
class Served:
    """A deployment this process registered: its full name, the flow it runs, the record, and
    `refusal(flow_run, record)`: why the flow would refuse that flow run (None: start it)."""

    name: str
    flow: Any
    record: dict[str, Any]
    refusal: Callable[[Any, Any], str | None] | None = None

    @property
    def entrypoint(self) -> str:  # a module path: the same file wherever the serve was started
        return f"{self.flow.fn.__module__}:{self.flow.fn.__name__}"


def expected_record(deployment) -> dict[str, Any]:
    """The GUARDED fields as `grpo serve` registers a RunnerDeployment (no work pool, no storage)."""
    return {
        "pull_steps": [],
        "entrypoint": deployment.entrypoint,
        "path": deployment._path,  # the path RunnerDeployment sends, and only has privately
        "job_variables": {},
        "work_pool_name": None,
        "work_queue_name": None,
        "storage_document_id": None,
        "infrastructure_document_id": None,
        "parameter_openapi_schema": deployment._parameter_openapi_schema.model_dump(exclude_unset=True),
        "enforce_parameter_schema": deployment.enforce_parameter_schema,
    }


def changed_fields(record: dict[str, Any], current) -> list[str]:
    """The GUARDED fields of a deployment as the server has it (`current`) that differ from `record`."""
    out = []
    for field in GUARDED:
        value = getattr(current, field, None)
        if field in _EMPTY and not value:
            value = _EMPTY[field]
        if value != record[field]:
            out.append(field)
    return out


def changed_message(name: str, fields: list[str]) -> str:
    return (
        f"the deployment {name} was changed on the server since grpo serve registered it: {', '.join(fields)}; "
        "grpo serve runs only the deployment it registered, so nothing of this flow run ran; restart grpo serve "
        "to register it again"
    )


def _values(record, fields: list[str]) -> str:
    """`fields` of a deployment's record as field=value, each value cut at 160 characters."""
    out = []
    for field in fields:
        text = repr(getattr(record, field, None))
        out.append(f"{field}={text if len(text) <= 160 else text[:157] + '...'}")
    return ", ".join(out)


class NotStartedError(Exception):
    """A flow run failed before its process started (its message says why, in its log and state)."""


class DeploymentChangedError(NotStartedError):
    """A flow run refused because its deployment's record changed (its message says which fields)."""


class _QuietRefusals(logging.Filter):
    """The executor logs a starter's exception with its traceback; a refusal is said once, plainly."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BaseExceptionGroup):  # raised in the executor's task group: kept if it holds another
            return exc.split(NotStartedError)[1] is not None
        return not isinstance(exc, NotStartedError)


logging.getLogger("prefect.runner.flow_run_executor").addFilter(_QuietRefusals())


class ServeRunner(Runner):
    """Prefect's Runner, with the deployments it serves bound to the code this process registered.
    `token`: this process's mark in their `version`; `on_taken_over(names, version)` is called (in
    the runner's loop) once some of them carry another, after which it polls no more."""

    def __init__(self, token: str, on_taken_over: Callable[[list[str], str], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.token = token
        self.served: dict[UUID, Served] = {}
        self._on_taken_over = on_taken_over
        self._taken_over = False

    def serve_deployment(self, deployment, flow, refusal: Callable[[Any, Any], str | None] | None = None) -> UUID:
        """Register `deployment` (running `flow`) with the API and with this runner, every GUARDED
        field of its record included: add_deployment updates only the fields set on the deployment
        object (pull_steps and entrypoint, not `path`, the work pool or the job variables), so what
        differs after it is set again here. Says what an earlier record held that grpo serve does not
        register (an earlier PATCH). `refusal(flow_run, record)`: why the flow would refuse a flow
        run of it, checked before its process starts (None: start it). Returns the deployment's id."""
        served = Served(f"{deployment.flow_name}/{deployment.name}", flow, expected_record(deployment), refusal)
        with get_client(sync_client=True) as client:
            try:
                before = client.read_deployment_by_name(served.name)
            except ObjectNotFound:
                before = None
            deployment_id = self.add_deployment(deployment)
            # hooks after a cancel or a crash are looked up here, not loaded from the record's code
            self._deployment_registry.register_flow(deployment_id, flow)
            self.served[deployment_id] = served
            fields = changed_fields(served.record, client.read_deployment(deployment_id))
            if fields:
                client.update_deployment(deployment_id, DeploymentUpdate(**{f: served.record[f] for f in fields}))
                left = changed_fields(served.record, client.read_deployment(deployment_id))
                if left:
                    raise RuntimeError(f"grpo serve could not register {served.name} again: {', '.join(left)}")
        changed = changed_fields(served.record, before) if before is not None else []
        if changed:
            print(
                f"grpo serve: {served.name}'s record on the server had {_values(before, changed)}, not as grpo serve "
                "registers it (changed since a grpo serve registered it): registered again",
                file=sys.stderr,
            )
        return deployment_id

    async def __aenter__(self):
        await super().__aenter__()
        poller = self._scheduled_run_poller
        # Prefect 3.8.8's poller: each flow run gets the starter _resolve_starter returns, and each
        # poll is _get_and_submit_flow_runs (ScheduledRunPoller.run looks it up when it starts)
        for name in ("_resolve_starter", "_get_and_submit_flow_runs"):
            if not hasattr(poller, name):
                raise RuntimeError(f"grpo serve needs Prefect's ScheduledRunPoller.{name} (Prefect 3.8.8's runner)")
        poller._resolve_starter = self._starter
        poller._get_and_submit_flow_runs = partial(self._poll_if_owned, poller._get_and_submit_flow_runs)
        return self

    def _starter(self, flow_run) -> _OwnCode:
        return _OwnCode(self, self.served.get(flow_run.deployment_id))

    async def _poll_if_owned(self, poll, task_group: anyio.abc.TaskGroup | None = None) -> None:
        if not self._taken_over:
            deployments = await self._client.read_deployments(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=list(self.served)))
            )
            others = [d for d in deployments if d.version != self.token]
            if not others:
                await poll(task_group)
                return
            self._taken_over = True
            self._scheduled_run_poller.stopping = True  # no more polls, whatever the callback does
            taken = {d.id for d in others}
            self._on_taken_over([s.name for i, s in self.served.items() if i in taken], others[0].version or "")

    async def check_record(self, flow_run, served: Served | None) -> Any:
        """Fail `flow_run` (raising DeploymentChangedError) unless its deployment's record on the
        server is what this process registered; that record."""
        current, fields = None, []
        if served is None:
            message = f"its deployment {flow_run.deployment_id} is not one this grpo serve registered"
        else:
            current = await self._client.read_deployment(flow_run.deployment_id)
            fields = changed_fields(served.record, current)
            if not fields:
                return current
            message = changed_message(served.name, fields)
        # said once, where the run's log is read (the UI, the API) and on this process's console
        flow_run_logger(flow_run).error(f"{message} (now {_values(current, fields)})" if fields else message)
        await self._client.set_flow_run_state(flow_run.id, Failed(message=message))
        raise DeploymentChangedError(message)

    async def check_parameters(self, flow_run, served: Served, record: Any) -> None:
        """Fail `flow_run` (raising NotStartedError) where its flow would refuse its parameters or
        job variables: the flow's own message in its state, one line in its log, no process."""
        if served.refusal is None:
            return
        why = await anyio.to_thread.run_sync(served.refusal, flow_run, record)  # reads files: not in the loop
        if why is None:
            return
        message = f"ConfigError: {why}"
        flow_run_logger(flow_run).error("refused before any task ran: %s", message)  # as the flow says it
        await self._client.set_flow_run_state(flow_run.id, Failed(message=message))
        raise NotStartedError(message)


class _OwnCode:
    """A ProcessStarter (prefect.runner._flow_run_executor): the record checked, then Prefect's own
    `python -m prefect.engine` started with the entrypoint of the flow this process registered."""

    def __init__(self, runner: ServeRunner, served: Served | None) -> None:
        self._runner, self._served = runner, served

    async def start(self, flow_run, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        runner, served = self._runner, self._served
        record = await runner.check_record(flow_run, served)
        assert served is not None  # check_record refuses a deployment this process did not register
        await runner.check_parameters(flow_run, served, record)
        flow_run_logger(flow_run).info(
            "Loading the flow's code from %s (%s, grpo serve's own: the pull steps, path and entrypoint of "
            "the deployment's record on the server are not used)",
            inspect.getsourcefile(served.flow.fn),
            served.entrypoint,
        )
        starter = EngineCommandStarter(
            tmp_dir=runner._tmp_dir,  # as Prefect's own resolver passes them
            entrypoint=served.entrypoint,
            deployment_name=served.name.split("/", 1)[1],
            heartbeat_seconds=runner._heartbeat_seconds,
            control_channel=runner._control_channel,
        )
        await starter.start(flow_run, task_status=task_status)
