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
def test_a_task_stopped_by_sigterm_is_not_logged_as_a_crash(reason, said, tmp_path):
    from prefect.settings import PREFECT_API_URL

    from flows.logs import SERVE_TMP_ENV

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_LOGGING_COLORS": "false"}
    env[SERVE_TMP_ENV] = str(tmp_path)  # grpo serve's private folder, where it leaves the reason
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


def test_serves_private_files_follow_no_link_and_stale_folders_go(tmp_path, monkeypatch):
    """issue 52: grpo serve wrote grpo-stop-<flow run id>.txt in the shared temp folder, following
    a symlink another user planted there. Its files now live in a folder of its own (mkdtemp:
    0700), are written without following a link, and a folder a SIGKILLed serve left is removed by
    the next start."""
    import stat
    import tempfile

    from flows import logs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv(logs.SERVE_TMP_ENV, "")  # restored to what it was (unset) after the test
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"grpo-serve-{int(gone.stdout)}-abc"  # a serve that is gone
    stale.mkdir()
    (stale / "stop-x.txt").write_text("old")
    alive = tmp_path / f"grpo-serve-{os.getpid()}-def"  # this process: alive, kept
    alive.mkdir()
    folder = logs.private_folder()
    assert not stale.exists() and alive.exists() and os.environ[logs.SERVE_TMP_ENV] == folder
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and os.path.dirname(folder) == str(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("root's file")
    os.symlink(victim, logs.stop_file("run-1"))  # planted where the stop reason goes
    with pytest.raises(OSError):
        logs.write_private(logs.stop_file("run-1"), "grpo serve was stopped")
    assert victim.read_text() == "root's file"
    logs.write_private(logs.stop_file("run-2"), "stopped by SIGTERM")
    assert open(logs.stop_file("run-2")).read() == "stopped by SIGTERM"
