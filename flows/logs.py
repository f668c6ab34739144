"""Lines of Prefect's own log that say something untrue about this project's runs (issue 30,
item 6), rewritten where they are logged (the `prefect.flow_runs` and `prefect.task_runs`
loggers, so the UI's log and the console read the same), and who stopped a run:

- "Downloading flow code from storage at '.'": a served deployment's code is the folder the flow
  run starts in; nothing is downloaded (logged when a run starts, and again by the runner after a
  cancel, when it loads the flow to look for cancellation hooks). It becomes "Loading the flow's
  code from /path".
- "Finished in state Running()": what the engine says last when a cancel stopped the flow run (the
  runner, not the engine, then sets it Cancelled). It becomes "Finished: cancelled"; where nobody
  stopped the run, the engine could not record its end (its API did not answer), and says so.
- "Crash detected! Execution was aborted by a termination signal." and "Finished in state
  Crashed('Execution was aborted by a termination signal.')", both at ERROR: what the task that
  was running says when a cancel (or `grpo serve` stopped, or another SIGTERM) stopped the flow
  run. Its worker stopped at a step boundary with a checkpoint; nothing failed. They become
  "Stopped: <who stopped it>" and "Finished: interrupted", at INFO after a cancel and at WARNING
  after another SIGTERM (stop_level).
- "Engine execution exited with unexpected exception" and a traceback, at ERROR, after a deployment
  run whose config was refused (flows.pipeline.Refused) or a readiness run that found the run not
  ready: the flow logged one line saying why and its Failed state holds the message; the traceback
  of Prefect re-raising that state is dropped.

The filter is attached when flows.pipeline is imported (every flow-run process: grpo run, grpo
serve, a work-pool worker); the first line comes before that import, so `grpo serve` gives its
flow runs a logging config with the filter (`quiet_logging_config`), derived from Prefect's own.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from typing import Any

import yaml
from prefect.logging.configuration import DEFAULT_LOGGING_SETTINGS_PATH
from prefect.runtime import flow_run
from prefect.settings import PREFECT_LOGGING_SETTINGS_PATH

from grpo_core.store.lease import process_alive

LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
FILTER = "grpo_engine_lines"
_TERMINATED = "Execution was aborted by a termination signal."  # Prefect's message for TerminationSignal


SERVE_TMP_ENV = "GRPO_SERVE_TMP"  # grpo serve's private folder, inherited by the flow runs it starts
_SERVE_TMP_PREFIX = "grpo-serve-"


def private_folder() -> str:
    """A folder of this process's own for the files `grpo serve` shares with its flow-run
    processes (stop reasons, the logging config): created with mkdtemp (0700, a fresh name), so
    no other user can plant a file or a symlink in it; its path goes into this process's
    environment, which the flow runs inherit. Folders that serve processes now gone left (a
    SIGKILLed serve) are removed first."""
    remove_stale_private_folders()
    folder = tempfile.mkdtemp(prefix=f"{_SERVE_TMP_PREFIX}{os.getpid()}-")
    os.environ[SERVE_TMP_ENV] = folder
    return folder


def remove_stale_private_folders() -> list[str]:
    """Remove the private folders of this user's serve processes that are gone; their paths."""
    removed = []
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        if not name.startswith(_SERVE_TMP_PREFIX):
            continue
        path = os.path.join(tmp, name)
        try:
            pid = int(name[len(_SERVE_TMP_PREFIX) :].split("-", 1)[0])
            st = os.lstat(path)
        except (ValueError, OSError):
            continue
        # only a real folder of this user's (never one behind a link), of a process that is gone
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or process_alive(pid, None):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def stop_file(flow_run_id: str) -> str | None:
    """Where `grpo serve` leaves who stopped a flow run it runs (read by stop_reason): in its
    private folder; None in a process no `grpo serve` started."""
    folder = os.environ.get(SERVE_TMP_ENV)
    return os.path.join(folder, f"stop-{flow_run_id}.txt") if folder else None


def write_private(path: str, text: str) -> None:
    """Write `path` (in the private folder), never following a link planted in its place."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _cancelled() -> bool:
    """Whether the SIGTERM this flow-run process got is a cancel (the UI's Cancel, the API's
    Cancelling state): Prefect's runner says so to the process before it signals it."""
    try:
        from prefect._internal.control_listener import get_intent  # Prefect's internals: may move

        return get_intent() == "cancel"
    except Exception:  # noqa: BLE001 - an older or newer Prefect: the other clues
        return False


def stop_reason() -> str:
    """Who sent the SIGTERM that stopped this flow run: a cancel in the UI or API, `grpo serve`
    stopped (it leaves its reason in stop_file), or another SIGTERM."""
    if _cancelled():
        return "the flow run was cancelled (the UI's Cancel or the API)"
    other = "the process running the flow was sent SIGTERM (a scheduler, a shutdown, or kill)"
    served = _serve_stopped()
    return other if served is None else served


def _serve_stopped() -> str | None:
    """Why `grpo serve` stopped this flow run (what it left in stop_file), or None if it did not."""
    path = stop_file(flow_run.id)
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            return f.read().strip() or "grpo serve was stopped"
    except OSError:
        return None


def stop_level() -> int:
    """How loud a run stopped by SIGTERM says so: INFO after a cancel (what the user asked for),
    WARNING after another SIGTERM (a shutdown, a scheduler: nobody here asked)."""
    return logging.INFO if _cancelled() else logging.WARNING


def _level(record: logging.LogRecord, level: int) -> None:
    record.levelno, record.levelname = level, logging.getLevelName(level)


class EngineLines(logging.Filter):
    """Rewrites the lines above; every other record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if msg == "Downloading flow code from storage at %r" and record.args == (".",):
            record.msg, record.args = "Loading the flow's code from %s", (os.getcwd(),)
        elif isinstance(msg, str) and msg.startswith("Downloading flow code from storage at '.'"):
            record.msg, record.args = f"Loading the flow's code from {os.getcwd()}", ()
        elif msg == "Finished in state Running()":
            if _cancelled() or _serve_stopped() is not None:
                record.msg, record.args = "Finished: cancelled (the runner sets the flow run Cancelled)", ()
            else:  # nobody stopped it: the engine could not record its end (the API did not answer)
                record.msg, record.args = "Finished without a final state: the Prefect API did not take it", ()
        elif msg == f"Crash detected! {_TERMINATED}":
            record.msg, record.args = "Stopped: %s", (stop_reason(),)
            _level(record, stop_level())
        elif msg == f"Finished in state Crashed({_TERMINATED!r})":
            record.msg, record.args = "Finished: interrupted (Prefect marks the task run Crashed)", ()
            _level(record, stop_level())
        elif msg == "Engine execution exited with unexpected exception" and _refused(record.exc_info):
            return False  # a refused deployment run: its one line said why, its state holds the message
        return True


ANSWERS = ("ConfigError: ", "not ready: ")  # the Failed states a flow returns after logging why


def _refused(exc_info) -> bool:
    """Whether a record's exception is the engine re-raising a Failed state the flow returned after
    logging why: a refused deployment run (flows.pipeline.Refused: 'ConfigError: ...') or a
    readiness run's 'not ready: ...', nothing the run did wrong."""
    exc = exc_info[1] if exc_info else None
    return type(exc).__name__ == "FailedRun" and str(exc).startswith(ANSWERS)


def attach() -> None:
    """The filter on Prefect's flow-run and task-run loggers in this process (once)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, EngineLines) for f in logger.filters):
            logger.addFilter(EngineLines())


def quiet_logging_config() -> str | None:
    """A copy of the logging config Prefect uses here with the filter on its flow-run logger,
    written in grpo serve's private folder (private_folder); its path is for PREFECT_LOGGING_SETTINGS_PATH in the
    flow-run processes `grpo serve` starts. None where Prefect's config cannot be read."""
    own = PREFECT_LOGGING_SETTINGS_PATH.value()
    source = own if own.exists() else DEFAULT_LOGGING_SETTINGS_PATH
    try:
        config: dict[str, Any] = yaml.safe_load(source.read_text())
        loggers = [config.setdefault("loggers", {}).setdefault(name, {}) for name in LOGGERS]
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    config.setdefault("filters", {})[FILTER] = {"()": f"{__name__}.EngineLines"}
    for logger in loggers:
        if FILTER not in logger.setdefault("filters", []):
            logger["filters"].append(FILTER)
    fd, path = tempfile.mkstemp(prefix="logging-", suffix=".yml", dir=os.environ.get(SERVE_TMP_ENV))
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return path
