"""One retry policy on every path (issue 30): runs submitted through the API as the UI's form
does, served by a real `grpo serve` against a real `prefect server start`, counted by their
run_count. A failure a retry can fix runs 1 + pipeline.flow_retries times (the form's value:
the flow decorator's retries=1 used to win), a config, data or reward error and a storage error
that cannot fix itself once."""

import json
import socket
import subprocess
import uuid

import pytest

from tests.test_deployments import BIN, _flatten, _stop, _wait, client_env, served_client, tiny

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(server, tmp_path_factory):  # noqa: F811
    url, home = server
    root = tmp_path_factory.mktemp("runs")
    with socket.socket() as s:  # a gs:// endpoint nothing listens on: connection refused, a retryable storage error
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    env = {**client_env(home, url), "STORAGE_EMULATOR_HOST": f"127.0.0.1:{closed}"}
    sets = [f"{k}={json.dumps(v)}" for k, v in _flatten(tiny(root, "default")).items()]
    # the runs below write and read in the tests' temporary folders and an unreachable bucket
    allow = ["--allow-root", str(tmp_path_factory.getbasetemp()), "--allow-root", "gs://grpo-unreachable"]
    proc = subprocess.Popen(
        [f"{BIN}/grpo", "serve", *allow, *sum((["--set", s] for s in sets), [])],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    with served_client(url, proc) as client:
        yield client, root
    _stop(proc)


def attempts(client, config: dict) -> tuple[int, str]:
    """Submit `config` as the form does; the flow run's run_count and final message once it ends."""
    from prefect.deployments import run_deployment

    run = run_deployment("grpo-pipeline/pipeline", parameters={"config": config}, timeout=0)
    run = _wait(client, run.id, timeout=240)
    assert run.state.is_failed(), run.state.message
    return run.run_count, run.state.message or ""


@pytest.mark.parametrize("flow_retries", [0, 2])
def test_a_retryable_failure_runs_one_plus_flow_retries_times(served, flow_retries):
    client, _ = served
    config = tiny("gs://grpo-unreachable/runs", f"net-{flow_retries}", retries=0, flow_retries=flow_retries)
    count, message = attempts(client, config)
    assert "cannot connect to the storage host" in message
    assert count == 1 + flow_retries  # before: 2 whatever the form said


def test_errors_that_fail_the_same_way_run_once(served, tmp_path, tmp_path_factory):
    client, root = served
    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n' * 4)  # 4 rows: fewer than eval_rows + a batch
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    elsewhere = tmp_path_factory.getbasetemp().parent / f"not-allowed-{uuid.uuid4().hex[:8]}"  # outside every root
    cases = {
        # a config error found after submission: rloo with the default scale_rewards
        "rloo": ({**tiny(root, "rloo", flow_retries=2), "train": {"grpo": {"advantage": "rloo"}}}, "scale_rewards"),
        "reward": ({**tiny(root, "reward", flow_retries=2), "rewards": [{"function": "nope.py:f"}]}, "nope.py"),
        "data": ({**tiny(root, "data", flow_retries=2), "data": {"source": str(data)}}, str(data)),
        "storage": (tiny(blocker, "storage", retries=2, flow_retries=2), "a path in it is a file, not a folder"),
        # issue 28: places outside the served config's and the allowed roots, refused before anything is written
        "write": (tiny(elsewhere, "write", flow_retries=2), "storage.root='" + str(elsewhere)),
        "read": ({**tiny(root, "read", flow_retries=2), "data": {"source": __file__}}, f"data.source='{__file__}'"),
    }
    counts = {}
    for name, (config, said) in cases.items():
        counts[name], message = attempts(client, config)
        assert said in message, (name, message)
    # refused by the config's own check or the trust policy: grpo serve fails the run before its
    # process starts (0 runs of the flow); the others fail in the flow, which runs once
    assert counts == {"rloo": 0, "reward": 0, "data": 1, "storage": 1, "write": 0, "read": 0}
    assert not elsewhere.exists() and not (root / "read").exists()
