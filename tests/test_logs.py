"""flows/logs.py on Prefect's own lines (issue 30, item 6): a task that a SIGTERM stopped (a cancel,
`grpo serve` stopped, a shutdown) logged "Crash detected! Execution was aborted by a termination
signal." and "Finished in state Crashed(...)" at ERROR, though its worker stopped at a step
boundary with a checkpoint and nothing failed. A real flow run in a process of its own (Prefect
ends the process with the signal) on the session's Prefect server; the cancel itself (INFO,
"cancelled") is tested through `grpo serve` in test_served_ui."""

import os
import re
import subprocess
import sys

import pytest


@pytest.mark.usefixtures("prefect_server")
@pytest.mark.parametrize(
    "reason, said",
    [
        ("", "the process running the flow was sent SIGTERM (a scheduler, a shutdown, or kill)"),
        ("grpo serve (pid 7) was stopped by SIGTERM", "grpo serve (pid 7) was stopped by SIGTERM"),
    ],
)
def test_a_task_stopped_by_sigterm_is_not_logged_as_a_crash(reason, said):
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_LOGGING_COLORS": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.stopped_task", reason], env=env, capture_output=True, text=True, timeout=300
    )
    # "12:00:00.000 | WARNING | Task run 'training-abc' - Stopped: ..."
    lines = re.findall(r"^\S+ \| (\w+) +\| Task run '[^']*' - (.*)$", proc.stderr, re.M)
    assert lines and proc.returncode == -15, proc.stderr[-3000:]
    assert not [line for line in lines if line[0] in ("ERROR", "CRITICAL")], lines
    # not a cancel (no Cancelling state behind this SIGTERM): a warning, saying who stopped it
    assert ("WARNING", f"Stopped: {said}") in lines, lines
    assert ("WARNING", "Finished: interrupted (Prefect marks the task run Crashed)") in lines, lines
