"""The local process work pool as deployments/README.md documents it, against a real `prefect server
start` and a real `prefect worker`: the README's commands run exactly as written there (from the
repository root), `prefect deploy --all` succeeds and touches only the pool it created, the nightly
deployment (a placeholder bucket) gets no active schedule, a worker started without
GRPO_PROJECT_DIR fails a run with a message that names it, and with it a run completes."""

import json
import os
import pathlib
import re
import subprocess
import time
from contextlib import contextmanager

import pytest

from flows.serve import SERVED_NAMES
from grpo_core.store.root import RunRoot
from tests.prefect_server import api_client
from tests.test_deployments import AUTH, BIN, _stop, _wait, tiny, wait_logs
from tests.test_interrupt import _alive, _descendants

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]


def recipe() -> list[str]:
    """The command lines of the README's work-pool recipe, as a user would type them."""
    text = (ROOT / "deployments" / "README.md").read_text()
    block = re.search(r"<!-- work-pool-recipe\b.*?-->\s*```bash\n(.*?)```\s*<!-- /work-pool-recipe -->", text, re.S)
    assert block, "deployments/README.md has no work-pool recipe block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def cli_env(url: str, home) -> dict:
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # the README: the venv's bin/ on PATH
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": url,
        "PREFECT_API_AUTH_STRING": AUTH,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
    }
    env.pop("GRPO_PROJECT_DIR", None)
    return env


def run_line(line: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


@contextmanager
def worker(line: str, env: dict, log_path):
    """A worker started by a README line, in its own process group, stopped with its children."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["bash", "-c", line], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
        _runs_exit(proc.pid)
    finally:
        _stop(proc)


def _runs_exit(worker_pid: int, timeout: float = 120) -> None:
    """Wait until the flow-run processes the worker started have exited: a run's process sets its
    final state, then sends its last log lines on its way out (a stop then would lose them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [pid for pid in _alive(_descendants(worker_pid)) if b"prefect.engine" in _cmdline(pid)]:
            return
        time.sleep(0.5)


def _cmdline(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # it has just exited
        return b""


@pytest.fixture(scope="module")
def deployed(server, tmp_path_factory):
    url, home = server
    lines = recipe()
    assert len(lines) == 4 and lines[-1].startswith("GRPO_PROJECT_DIR=") and " worker start " in lines[-1], lines
    # the runs below write in the tests' temporary folders, not the pool deployment's storage.root
    env = {**cli_env(url, home), "GRPO_ALLOW_ROOTS": str(tmp_path_factory.getbasetemp())}
    for line in lines[:3]:  # create the pool, set its limit, deploy
        done = run_line(line, env)
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    with api_client(url) as client:
        yield client, env, lines[-1]


def test_recipe_deploys_the_pool_and_nothing_else(deployed):
    client, _, _ = deployed
    from prefect.client.schemas.filters import DeploymentFilter
    from prefect.exceptions import ObjectNotFound

    assert client.read_work_pool("grpo-local").concurrency_limit == 1
    deps = client.read_deployments(deployment_filter=DeploymentFilter())
    flows = {f.id: f.name for f in client.read_flows()}
    names = {f"{flows[d.flow_id]}/{d.name}" for d in deps}
    assert names == {
        "grpo-pipeline/pool",
        "grpo-pipeline/pool-resume",
        "grpo-pipeline/pool-nightly",
        "grpo-evaluate/pool",
        "grpo-evaluate/pool-evaluate-nightly",
        "grpo-readiness/pool",
    }
    assert {d.work_pool_name for d in deps} == {"grpo-local"}
    for served_name in SERVED_NAMES:
        with pytest.raises(ObjectNotFound):  # the names `grpo serve` owns are left to it
            client.read_deployment_by_name(served_name)
    for name in ("grpo-pipeline/pool-resume", "grpo-pipeline/pool-nightly", "grpo-evaluate/pool-evaluate-nightly"):
        scheduled = client.read_deployment_by_name(name)
        assert "YOUR-BUCKET" in json.dumps(scheduled.parameters)
        assert [s.active for s in scheduled.schedules] == [False]  # a placeholder bucket never runs on a schedule
        assert scheduled.paused and scheduled.description  # the UI's list shows it paused, with what it does
    nightly = client.read_deployment_by_name("grpo-pipeline/pool-nightly")
    assert nightly.parameters["config"]["run_name"] == "nightly-{date}"
    assert client.read_deployment_by_name("grpo-pipeline/pool-resume").concurrency_options.collision_strategy == (
        "CANCEL_NEW"
    )


def test_worker_without_project_dir_fails_naming_it(deployed, tmp_path):
    client, env, worker_line = deployed
    from prefect.deployments import run_deployment

    bare = re.sub(r"^(\w+=\S*\s+)+", "", worker_line)  # the documented worker line, less GRPO_PROJECT_DIR=...
    run = run_deployment("grpo-pipeline/pool", parameters={"config": tiny(tmp_path, "no-dir")}, timeout=0)
    with worker(bare, env, tmp_path / "worker.log"):
        run = _wait(client, run.id, timeout=120)
        assert run.state.is_failed(), (run.state, (tmp_path / "worker.log").read_text()[-3000:])
        assert "GRPO_PROJECT_DIR" in run.state.message and "prefect worker start" in run.state.message
        named = lambda log: "GRPO_PROJECT_DIR" in log.message and log.level >= 40
        logs = wait_logs(client, run.id, lambda logs: any(map(named, logs)))
        assert any(map(named, logs)), [(log.level, log.message[:200]) for log in logs]
    assert not (tmp_path / "no-dir").exists()


def test_worker_with_project_dir_runs_the_pipeline(deployed, tmp_path):
    """A run completes; a run whose config the worker's policy refuses (a reward module) is refused
    by the flow itself, before any task: no grpo serve checked it first here."""
    client, env, worker_line = deployed
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId, FlowRunFilterId
    from prefect.deployments import run_deployment

    run = run_deployment("grpo-pipeline/pool", parameters={"config": tiny(tmp_path, "pool-run")}, timeout=0)
    bad = dict(tiny(tmp_path, "refused"), rewards=[{"function": "os:system"}])
    refused = run_deployment("grpo-readiness/pool", parameters={"config": bad}, timeout=0)
    with worker(worker_line, env, tmp_path / "worker.log"):
        run = _wait(client, run.id, timeout=300)
        refused = _wait(client, refused.id, timeout=300)
    assert run.state.is_completed(), (run.state, (tmp_path / "worker.log").read_text()[-3000:])
    said = "ConfigError: rewards[0].function 'os:system' may not run in a deployment run"
    assert refused.state.is_failed() and refused.state.message.startswith(said), refused.state.message
    assert client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[refused.id]))) == []
    line = lambda log: log.message.startswith("refused before any task ran: " + said) and log.level >= 40
    logs = wait_logs(client, refused.id, lambda logs: any(map(line, logs)))
    assert any(map(line, logs)), ([log.message[:200] for log in logs], (tmp_path / "worker.log").read_text()[-3000:])
    assert not (tmp_path / "refused").exists()
    summary = RunRoot(str(tmp_path / "pool-run")).read_json("summary.json")
    assert summary["status"] == "completed" and summary["steps"] == 4
    # the scheduler has had this whole module to act: still nothing scheduled for the nightly deployment
    nightly = client.read_deployment_by_name("grpo-pipeline/pool-nightly")
    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[nightly.id]))
    )
    assert runs == []


def test_a_patched_pull_step_runs_and_the_flow_refuses_the_run(deployed, tmp_path):
    """A worker runs the deployment record's pull steps before any code of this project's: a PATCH
    that adds one runs it (the marker exists: only the server's auth string stops that, docs/trust.md),
    and the flow then refuses the run before any task, naming pull_steps (flows/pool_record.py)."""
    client, env, worker_line = deployed
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    marker = tmp_path / "pulled"
    dep = client.read_deployment_by_name("grpo-readiness/pool")
    step = {"prefect.deployments.steps.run_shell_script": {"script": f"touch {marker}"}}
    client.update_deployment(dep.id, DeploymentUpdate(pull_steps=[step, *dep.pull_steps]))
    run = client.create_flow_run_from_deployment(dep.id, parameters={"config": tiny(tmp_path, "patched")})
    with worker(worker_line, env, tmp_path / "worker.log"):
        run = _wait(client, run.id, timeout=180)
    assert run.state.is_failed(), (run.state, (tmp_path / "worker.log").read_text()[-3000:])
    assert "grpo-readiness/pool on the server is not as deployments/prefect.yaml deploys it: pull_steps." in (
        run.state.message
    ), run.state.message
    assert marker.exists()
    assert client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))) == []
