"""`grpo serve` and `prefect deploy` against one real `prefect server start`: a `grpo serve` that
stops pauses only the deployments it still owns (an older one, taken over by a newer one, exits by
itself and leaves the newer one's schedule running; the last one to stop pauses them, even when
stopped as soon as it registered),
and deploying the work-pool file leaves the deployments `grpo serve` made, their parameters and
schedule, as it set them."""

import json
import os
import subprocess
import time

import pytest

from flows.serve import SERVED_NAMES
from tests.test_deployments import AUTH, BIN, _flatten, _stop, tiny
from tests.test_work_pool import api_client, cli_env, recipe, run_line

pytestmark = pytest.mark.slow


def start_serve(url: str, home, log_path, *args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": url,
        "PREFECT_API_AUTH_STRING": AUTH,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [f"{BIN}/grpo", "serve", *args], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def registered(client, proc: subprocess.Popen, log_path, timeout: float = 120) -> dict:
    """The deployments `grpo serve` serves, once `proc` has registered them all: each carries that
    process's ownership mark (its pid) in its version."""
    deadline = time.monotonic() + timeout
    while True:
        deps = {}
        for name in SERVED_NAMES:
            try:
                dep = client.read_deployment_by_name(name)
            except Exception:  # noqa: BLE001 - not registered yet
                break
            if f" pid {proc.pid} " not in (dep.version or ""):
                break
            deps[name] = dep
        if len(deps) == len(SERVED_NAMES):
            return deps
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"grpo serve did not register {sorted(set(SERVED_NAMES) - set(deps))}"
        time.sleep(0.5)


def test_an_older_serve_taken_over_leaves_the_newer_ones_schedule(server, tmp_path):
    url, home = server
    with api_client(url) as client:
        a = start_serve(url, home, tmp_path / "a.log", "--interval", "3600")
        b = None
        try:
            first = registered(client, a, tmp_path / "a.log")
            assert not first["grpo-pipeline/pipeline"].paused
            b = start_serve(url, home, tmp_path / "b.log", "--interval", "3600")
            registered(client, b, tmp_path / "b.log")
            assert a.wait(timeout=120) == 0  # taken over: it exits at its next poll (tests/test_serve_record.py)
            for name in SERVED_NAMES:
                assert not client.read_deployment_by_name(name).paused, f"stopping the older grpo serve paused {name}"
            dep = client.read_deployment_by_name("grpo-pipeline/pipeline")
            assert [s.active for s in dep.schedules] == [True]  # B's schedule: still running
            _stop(b)
            for name in SERVED_NAMES:
                assert client.read_deployment_by_name(name).paused, f"the last grpo serve left {name} running"
        finally:
            _stop(a)
            if b is not None:
                _stop(b)


def test_serve_stopped_while_starting_pauses_what_it_owns(server, tmp_path):
    """SIGTERM between registering the deployments and the runner's start (its own SIGTERM handler)."""
    url, home = server
    with api_client(url) as client:
        proc = start_serve(url, home, tmp_path / "serve.log", "--interval", "3600")
        try:
            registered(client, proc, tmp_path / "serve.log")
        finally:
            _stop(proc)
        for name in SERVED_NAMES:
            assert client.read_deployment_by_name(name).paused, f"a grpo serve stopped early left {name} running"


def test_prefect_deploy_leaves_served_deployments_alone(server, tmp_path):
    url, home = server
    sets = [f"{k}={json.dumps(v)}" for k, v in _flatten(tiny(tmp_path, "served")).items()]
    proc = start_serve(url, home, tmp_path / "serve.log", "--interval", "3600", *sum((["--set", s] for s in sets), []))
    try:
        with api_client(url) as client:
            before = registered(client, proc, tmp_path / "serve.log")["grpo-pipeline/pipeline"]
            assert not before.paused and before.parameters["config"]["run_name"] == "served"
            env = cli_env(url, home)
            for line in recipe()[:3]:  # the documented pool, its limit, `prefect deploy ... --all`
                done = run_line(line, env)
                assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            after = client.read_deployment_by_name("grpo-pipeline/pipeline")
            assert after.id == before.id and after.version == before.version
            assert after.parameters == before.parameters and not after.paused
            assert after.work_pool_name is None
            assert [(s.schedule, s.active) for s in after.schedules] == [
                (s.schedule, s.active) for s in before.schedules
            ]
            assert client.read_deployment_by_name("grpo-pipeline/pool").work_pool_name == "grpo-local"
    finally:
        _stop(proc)
