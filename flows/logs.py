"""Two lines of Prefect's own flow-run log that say something untrue about this project's runs
(issue 30, item 6), rewritten where they are logged (the `prefect.flow_runs` logger, so the
UI's log and the console read the same):

- "Downloading flow code from storage at '.'": a served deployment's code is the folder the flow
  run starts in; nothing is downloaded (logged when a run starts, and again by the runner after a
  cancel, when it loads the flow to look for cancellation hooks). It becomes "Loading the flow's
  code from /path".
- "Finished in state Running()": what the engine says last when a cancel stopped the flow run (the
  runner, not the engine, then sets it Cancelled). It becomes "Finished: cancelled".

The filter is attached when flows.pipeline is imported (every flow-run process: grpo run, grpo
serve, a work-pool worker); the first line comes before that import, so `grpo serve` gives its
flow runs a logging config with the filter (`quiet_logging_config`), derived from Prefect's own.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

LOGGER = "prefect.flow_runs"
FILTER = "grpo_engine_lines"


class EngineLines(logging.Filter):
    """Rewrites the two lines above; every other record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if msg == "Downloading flow code from storage at %r" and record.args == (".",):
            record.msg, record.args = "Loading the flow's code from %s", (os.getcwd(),)
        elif isinstance(msg, str) and msg.startswith("Downloading flow code from storage at '.'"):
            record.msg, record.args = f"Loading the flow's code from {os.getcwd()}", ()
        elif msg == "Finished in state Running()":
            record.msg, record.args = "Finished: cancelled (the runner sets the flow run Cancelled)", ()
        return True


def attach() -> None:
    """The filter on Prefect's flow-run logger in this process (once)."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, EngineLines) for f in logger.filters):
        logger.addFilter(EngineLines())


def quiet_logging_config() -> str | None:
    """A copy of the logging config Prefect uses here with the filter on its flow-run logger,
    written under the system temp folder; its path is for PREFECT_LOGGING_SETTINGS_PATH in the
    flow-run processes `grpo serve` starts. None where Prefect's config cannot be read."""
    import yaml
    from prefect.logging.configuration import DEFAULT_LOGGING_SETTINGS_PATH
    from prefect.settings import PREFECT_LOGGING_SETTINGS_PATH

    own = PREFECT_LOGGING_SETTINGS_PATH.value()
    source = own if own.exists() else DEFAULT_LOGGING_SETTINGS_PATH
    try:
        config: dict[str, Any] = yaml.safe_load(source.read_text())
        logger = config.setdefault("loggers", {}).setdefault(LOGGER, {})
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    config.setdefault("filters", {})[FILTER] = {"()": f"{__name__}.EngineLines"}
    if FILTER not in logger.setdefault("filters", []):
        logger["filters"].append(FILTER)
    fd, path = tempfile.mkstemp(prefix=f"grpo-logging-{os.getpid()}-", suffix=".yml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return path
