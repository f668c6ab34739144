"""A flow whose task is stopped by SIGTERM as a cancel's or a shutdown's reaches a running task
(Prefect raises TerminationSignal in the flow-run process, then ends the process with the
signal), for tests/test_logs.py: `python -m tests.stopped_task [REASON]`, REASON what `grpo serve`
would leave for the run it stops."""

import os
import signal
import sys

from prefect import flow, task
from prefect.runtime import flow_run

import flows.pipeline  # noqa: F401 - attaches flows.logs' filter, as in every flow-run process
from flows.logs import stop_file, write_private


@task
def training() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # Prefect's handler raises TerminationSignal here
    signal.pause()


@flow
def stopped(reason: str = "") -> None:
    if reason:  # as grpo serve does: in its private folder (GRPO_SERVE_TMP, which the test sets)
        write_private(stop_file(flow_run.id), reason)
    training()


if __name__ == "__main__":
    stopped(sys.argv[1] if len(sys.argv) > 1 else "")
