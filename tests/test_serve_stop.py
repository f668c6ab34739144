"""`grpo serve` stopped while it runs a flow run (issue 30, item 8): before, SIGTERM killed the
run with no checkpoint and no summary, left lease.json, and the API showed it Running 17 minutes
later, holding the deployment's only concurrency slot. A real `prefect server start`, a real
`grpo serve`; the run submitted through the API as the UI does."""

import glob
import json
import os
import signal
import subprocess
import tempfile
import time

import pytest

from grpo_core.store.lease import LEASE
from grpo_core.store.root import RunRoot
from tests.test_deployments import BIN, _flatten, _stop, _wait, client_env, served_client, tiny, wait_logs

pytestmark = pytest.mark.slow


def start_serve(server, root, log_path) -> subprocess.Popen:  # noqa: F811
    url, home = server
    sets = [f"{k}={json.dumps(v)}" for k, v in _flatten(tiny(root, "default")).items()]
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [f"{BIN}/grpo", "serve", *sum((["--set", s] for s in sets), [])],
            env=client_env(home, url),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def long_run(root, name: str) -> dict:
    """Long enough to be stopped in training (tiny preset: ~40 ms a step), a checkpoint every 10 steps."""
    config = tiny(root, name, epochs=1, checkpoint_every=10, retries=0)
    return {**config, "train": {**config["train"], "num_steps": 2000}}


def wait_training(client, run_id, run_dir, timeout=240) -> None:
    deadline = time.monotonic() + timeout
    while not any((run_dir / "checkpoints").glob("[0-9]*")):
        state = client.read_flow_run(run_id).state
        assert not state.is_final(), state.message
        assert time.monotonic() < deadline, f"no checkpoint in {run_dir} ({state.name})"
        time.sleep(0.5)


def test_sigterm_to_serve_stops_its_run_as_a_cancel_does(server, tmp_path):  # noqa: F811
    from prefect.deployments import run_deployment

    url, _ = server
    root = tmp_path / "runs"
    serve = start_serve(server, root, tmp_path / "serve.log")
    try:
        with served_client(url, serve) as client:
            run = run_deployment("grpo-pipeline/pipeline", parameters={"config": long_run(root, "stopped")}, timeout=0)
            wait_training(client, run.id, root / "stopped")
            t = time.monotonic()
            os.kill(serve.pid, signal.SIGTERM)  # the serve process alone, as `docker stop` does
            serve.wait(timeout=120)
            took = time.monotonic() - t
            run = client.read_flow_run(run.id)
            log = (tmp_path / "serve.log").read_text()
            assert run.state.is_final() and run.state.type.value in ("CANCELLED", "CRASHED"), (run.state, log[-3000:])
            rr = RunRoot(str(root / "stopped"))
            summary = rr.read_json("summary.json")
            assert summary["status"] == "interrupted", summary
            assert f"grpo serve (pid {serve.pid}) was stopped by SIGTERM" in summary["error"], summary["error"]
            assert not rr.exists(LEASE)  # released: the next run of this root is not refused
            assert summary["steps"] > 0 and took < 90, (summary["steps"], took)
            # its private folder (the stop reasons, the logging config) went with it
            assert not glob.glob(os.path.join(tempfile.gettempdir(), f"grpo-serve-{serve.pid}-*"))
    finally:
        _stop(serve)
    # the deployment's concurrency slot is free: a new serve runs the next run to the end
    serve = start_serve(server, root, tmp_path / "serve2.log")
    try:
        with served_client(url, serve) as client:
            run = run_deployment("grpo-pipeline/pipeline", parameters={"config": tiny(root, "next")}, timeout=0)
            assert _wait(client, run.id, timeout=240).state.is_completed()
            cancelled_cleanly(client, root)
    finally:
        _stop(serve)


def cancelled_cleanly(client, root) -> None:
    """issue 30, item 6: a run cancelled as the UI's Cancel does: its log said "Downloading flow
    code from storage at '.'" (nothing is downloaded) and ended "Finished in state Running()"."""
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    run = run_deployment("grpo-pipeline/pipeline", parameters={"config": long_run(root, "cancelled")}, timeout=0)
    wait_training(client, run.id, root / "cancelled")
    client.set_flow_run_state(run.id, Cancelling(), force=True)  # the UI's Cancel
    state = _wait(client, run.id, timeout=120).state
    assert state.is_cancelled(), state
    logs = wait_logs(client, run.id, lambda logs: any(log.message.startswith("Finished") for log in logs))
    messages = [log.message for log in logs]
    assert "Flow run was cancelled." in messages, messages[-10:]
    assert not [m for m in messages if "Finished in state Running()" in m or "storage at '.'" in m], messages
    assert "Finished: cancelled (the runner sets the flow run Cancelled)" in messages, messages[-10:]
    assert any(m.startswith("Loading the flow's code from /") for m in messages), messages[:5]
    summary = RunRoot(str(root / "cancelled")).read_json("summary.json")
    assert summary["status"] == "interrupted" and "cancelled" in summary["error"], summary


def test_the_next_serve_marks_the_runs_a_killed_serve_left(server, tmp_path):  # noqa: F811
    from prefect.deployments import run_deployment

    url, _ = server
    root = tmp_path / "runs"
    serve = start_serve(server, root, tmp_path / "serve.log")
    try:
        with served_client(url, serve) as client:
            run = run_deployment("grpo-pipeline/pipeline", parameters={"config": long_run(root, "orphan")}, timeout=0)
            wait_training(client, run.id, root / "orphan")
            os.killpg(serve.pid, signal.SIGKILL)  # the serve and its flow run, as a crash of the machine
            serve.wait(timeout=30)
            assert client.read_flow_run(run.id).state.is_running()  # what the API showed for 17 minutes
    finally:
        _stop(serve)
    serve = start_serve(server, root, tmp_path / "serve2.log")
    try:
        with served_client(url, serve) as client:
            deadline = time.monotonic() + 120
            while not (state := client.read_flow_run(run.id).state).is_final():
                assert time.monotonic() < deadline, state
                time.sleep(0.5)
            assert state.is_crashed(), state
            assert "is gone" in state.message, state.message
    finally:
        _stop(serve)
