"""A served deployment runs only the code `grpo serve` registered (issue 61, items 1, 2 and 9),
through one real `prefect server start` and real `grpo serve` processes:

- a PATCH of the deployment's pull_steps, or of its entrypoint and path, as a caller of the API can
  send it, fails the next flow run naming those fields before anything of it runs: the files the
  pull step or the other flow file would write stay absent, the run never reaches Running, no task
  runs;
- a PATCH that lands right after that check (tests/serve_patched.py) still runs nothing of it: the
  flow-run process starts with grpo serve's own entrypoint, and the flow that runs is ours (its
  trust policy refuses the run's storage.root);
- a second grpo serve takes the deployments over saying from whom, registers every field again
  (path and job variables included), and the first one says who took over, stops the run it
  trains as a SIGTERM of it does, and exits.

The two serves are the module's: the first serves the first two tests, the second takes over."""

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from grpo_core.store.root import RunRoot
from tests.prefect_server import AUTH, BIN, _stop, api_client, client_env
from tests.test_deployments import _wait
from tests.test_serve_ownership import registered

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Serving:
    client: object
    url: str
    home: Path
    proc: subprocess.Popen
    log: Path
    files: Path  # markers, the caller's flow file, the allowed root


def start(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def serve_args(files: Path) -> list[str]:
    return ["--limit", "2", "--allow-root", str(files)]  # as the serve ran


def shell_step(marker: Path) -> list[dict]:
    return [{"prefect.deployments.steps.run_shell_script": {"script": f"touch {marker}"}}]


def callers_flow(files: Path) -> Path:
    """A folder with a flow file of the caller's: importing it or running its flow writes a marker."""
    folder = files / "callers"
    folder.mkdir(exist_ok=True)
    (folder / "evil.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(files / 'imported')!r}).touch()\n"
        "from prefect import flow\n\n\n"
        "@flow(name='grpo-evaluate')\n"
        "def evil(run_url: str = '', steps: list = None):\n"
        f"    pathlib.Path({str(files / 'ran')!r}).touch()\n"
    )
    return folder


def patch(url: str, client, name: str, fields: dict) -> None:
    """PATCH /api/deployments/{id}, as any caller of the API can send it: again after a 503, as
    Prefect's own client does (the server answers 503 when SQLite stays locked by another write,
    which under load happens; CI's run met it once)."""
    dep = client.read_deployment_by_name(name)
    user, password = AUTH.split(":")
    for wait in (2, 4, 8, 16, 0):
        answer = httpx.patch(f"{url}/deployments/{dep.id}", json=fields, auth=(user, password), timeout=60)
        if answer.status_code != 503 or not wait:
            break
        time.sleep(wait)
    assert answer.status_code == 204, answer.text


def submit_and_wait(client, name: str, parameters: dict):
    """The flow run's final state, and the seconds from its submission to that state."""
    dep = client.read_deployment_by_name(name)
    run = client.create_flow_run_from_deployment(dep.id, parameters=parameters)
    t0 = time.monotonic()
    run = _wait(client, run.id, timeout=120)
    return run, time.monotonic() - t0


def nothing_ran(client, run) -> None:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.objects import StateType

    assert StateType.RUNNING not in {s.type for s in client.read_flow_run_states(run.id)}
    assert client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))) == []


@pytest.fixture(scope="module")
def first(server, tmp_path_factory):
    url, home = server
    files = tmp_path_factory.mktemp("record")
    log = files / "first.log"
    proc = start([f"{BIN}/grpo", "serve", *serve_args(files)], client_env(home, url), log)
    try:
        with api_client(url) as client:
            registered(client, proc, log)
            yield Serving(client, url, home, proc, log, files)
    finally:
        _stop(proc)


def test_a_patched_pull_step_never_runs(first):
    marker = first.files / "pulled"
    patch(first.url, first.client, "grpo-readiness/readiness", {"pull_steps": shell_step(marker)})
    run, seconds = submit_and_wait(first.client, "grpo-readiness/readiness", {})
    assert run.state.is_failed(), run.state
    assert "grpo-readiness/readiness was changed on the server" in run.state.message, run.state.message
    assert "registered it: pull_steps; " in run.state.message, run.state.message
    assert not marker.exists()
    nothing_ran(first.client, run)
    print(f"PATCH pull_steps: refused {seconds:.1f} s after submission")


def test_a_patched_entrypoint_and_path_never_load(first):
    folder = callers_flow(first.files)
    fields = {"entrypoint": "evil.py:evil", "path": str(folder)}
    patch(first.url, first.client, "grpo-evaluate/evaluate", fields)
    run, seconds = submit_and_wait(first.client, "grpo-evaluate/evaluate", {"run_url": str(first.files / "run")})
    assert run.state.is_failed(), run.state
    assert "registered it: entrypoint, path; " in run.state.message, run.state.message
    assert not (first.files / "imported").exists() and not (first.files / "ran").exists()
    assert not (ROOT / "evil.py").exists()  # the path's folder was not copied where the serve runs
    nothing_ran(first.client, run)
    print(f"PATCH entrypoint+path: refused {seconds:.1f} s after submission")


@pytest.fixture(scope="module")
def second(first):
    """A second grpo serve of the same deployments, started while the first one trains a run and
    once grpo-pipeline/train's path and job variables were PATCHed; each record it passes is
    PATCHed right after its check."""
    from tests.test_serve_stop import long_run, wait_training

    pipeline = first.client.read_deployment_by_name("grpo-pipeline/pipeline")
    config = long_run(first.files / "runs", "taken")
    running = first.client.create_flow_run_from_deployment(pipeline.id, parameters={"config": config})
    wait_training(first.client, running.id, first.files / "runs" / "taken")
    patch(first.url, first.client, "grpo-pipeline/train", {"path": str(first.files), "job_variables": {"env": {}}})
    after_check = {
        "pull_steps": shell_step(first.files / "raced-pull"),
        "entrypoint": "evil.py:evil",
        "path": str(callers_flow(first.files)),
    }
    env = {**client_env(first.home, first.url), "GRPO_TEST_PATCH_AFTER_CHECK": json.dumps(after_check)}
    log = first.files / "second.log"
    proc = start([sys.executable, "-m", "tests.serve_patched", *serve_args(first.files)], env, log)
    try:
        registered(first.client, proc, log)
        yield proc, log, running
    finally:
        _stop(proc)


def test_a_second_serve_takes_over_and_registers_every_field(first, second):
    """The first serve stops the run it trains as a SIGTERM of it does (the new one may start runs
    at once; the stopped run keeps its checkpoint for the UI's Retry) and exits."""
    proc, log, running = second
    first.proc.wait(timeout=120)  # it polls every 2 s (PREFECT_RUNNER_POLL_FREQUENCY), then stops its run
    said = first.log.read_text()
    assert first.proc.returncode == 0, said[-3000:]
    assert f" taken over by grpo serve pid {proc.pid} on " in said, said[-3000:]
    assert "picks up no more flow runs, stops the ones it runs and exits" in said
    assert first.client.read_flow_run(running.id).state.type.value in ("CANCELLED", "CRASHED")
    summary = RunRoot(str(first.files / "runs" / "taken")).read_json("summary.json")
    assert summary["status"] == "interrupted", summary
    assert f"was taken over by grpo serve pid {proc.pid} on " in summary["error"], summary["error"]
    took = log.read_text()
    assert "grpo serve: taking over grpo-pipeline/train, " in took
    assert f"from grpo serve pid {first.proc.pid} on " in took, took[-3000:]
    assert "grpo serve: grpo-pipeline/train's record on the server had path=" in took, took[-3000:]
    train = first.client.read_deployment_by_name("grpo-pipeline/train")
    assert (train.path, train.job_variables) == (".", {})
    evaluate = first.client.read_deployment_by_name("grpo-evaluate/evaluate")  # the earlier tests' PATCHes
    readiness = first.client.read_deployment_by_name("grpo-readiness/readiness")
    assert (evaluate.entrypoint, evaluate.path) == ("flows/pipeline.py:grpo_evaluate", ".")
    assert readiness.pull_steps in (None, [])


def test_a_patch_after_the_check_runs_nothing_of_it(first, second):
    """The PATCH lands once the run passed its check: the run trains as grpo serve registered it,
    and its cancel, after which Prefect's runner looks up the flow's cancellation hooks, loads
    nothing of the record either (that lookup loaded the record's code in grpo serve's process)."""
    from prefect.states import Cancelling

    from tests.test_serve_stop import long_run, wait_training

    client, root = first.client, first.files / "runs"
    dep = client.read_deployment_by_name("grpo-pipeline/pipeline")
    run = client.create_flow_run_from_deployment(dep.id, parameters={"config": long_run(root, "raced")})
    wait_training(client, run.id, root / "raced")  # our flow trains: nothing of the caller's replaced it
    record = client.read_deployment_by_name("grpo-pipeline/pipeline")
    assert record.entrypoint == "evil.py:evil" and record.pull_steps  # the PATCH landed before the flow loaded
    client.set_flow_run_state(run.id, Cancelling(), force=True)  # the UI's Cancel
    assert _wait(client, run.id, timeout=120).state.is_cancelled()
    assert not (first.files / "raced-pull").exists()
    assert not (first.files / "imported").exists() and not (first.files / "ran").exists()
    assert not (ROOT / "evil.py").exists()
