"""Deployments as production runs them: `prefect server start` on PostgreSQL, not SQLite.

A throwaway PostgreSQL cluster on 127.0.0.1 (tests/postgres.py: Debian's server binaries, skipped
without them), the Prefect server pointed at its `prefect` database with
PREFECT_API_DATABASE_CONNECTION_URL (it creates its tables on start), basic auth as in
test_deployments, `grpo serve` serving the deployments, and one run started through the API that
completes, its parameters and final state read back through the API and straight from PostgreSQL.
The server is stopped before the cluster, and must exit on SIGTERM by itself.
"""

import json
import os
import signal
import subprocess
import time

import pytest

from grpo_core.store.root import RunRoot
from tests.postgres import postgres  # noqa: F401 - the fixture
from tests.test_deployments import AUTH, BIN, _free_port, _get, _stop, _wait, tiny

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pg_server(postgres, tmp_path_factory):  # noqa: F811 - the fixture imported above
    home = tmp_path_factory.mktemp("prefect-home-pg")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not (k.startswith("PREFECT_") and "_DATABASE_" in k)}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_API_AUTH_STRING=AUTH,
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",
        PREFECT_SERVER_UI_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_API_URL="",
        PREFECT_API_DATABASE_CONNECTION_URL=postgres.url,
    )
    log = home / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [f"{BIN}/prefect", "server", "start", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 180
    try:
        while _get(f"{url}/health", AUTH) != 200:
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"prefect server did not start on PostgreSQL:\n{log.read_text()[-3000:]}\n{postgres.log()}"
            )
            time.sleep(0.5)
        yield url, home
    finally:
        _stop(proc)
    # SIGTERM alone stopped it (no SIGKILL), while the cluster was still up
    assert proc.returncode in (0, -signal.SIGTERM), (proc.returncode, log.read_text()[-3000:])


@pytest.fixture(scope="module")
def pg_served(pg_server, tmp_path_factory):
    """`grpo serve` against the PostgreSQL-backed server, no schedule."""
    url, home = pg_server
    root = tmp_path_factory.mktemp("served-runs-pg")
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": url,
        "PREFECT_API_AUTH_STRING": AUTH,
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    proc = subprocess.Popen(
        [f"{BIN}/grpo", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    try:
        with temporary_settings({PREFECT_API_URL: url, PREFECT_API_AUTH_STRING: AUTH}):
            from prefect.client.orchestration import get_client

            with get_client(sync_client=True) as client:
                deadline = time.monotonic() + 120
                while True:
                    try:
                        client.read_deployment_by_name("grpo-pipeline/pipeline")
                        break
                    except Exception:  # noqa: BLE001 - not registered yet
                        assert proc.poll() is None, proc.stderr.read()[-3000:]
                        assert time.monotonic() < deadline, "grpo serve did not register its deployments"
                        time.sleep(1)
                yield client, root
    finally:
        _stop(proc)


def test_server_runs_on_postgres(pg_server, postgres):  # noqa: F811
    url, home = pg_server
    assert _get(f"{url}/health", AUTH) == 200
    assert _get(f"{url}/version", None) == 401 and _get(f"{url}/version", AUTH) == 200
    tables = {t for (t,) in postgres.query("select tablename from pg_tables where schemaname = 'public'")}
    assert {"flow_run", "deployment", "alembic_version"} <= tables, sorted(tables)
    assert postgres.query("select count(*) from alembic_version")[0][0] == 1  # migrated on start
    assert not (home / "prefect.db").exists()  # no SQLite database beside it


def test_deployment_run_on_postgres(pg_served, postgres):  # noqa: F811
    client, root = pg_served
    from prefect.deployments import run_deployment

    config = tiny(root, "pg-run", epochs=1)
    run = run_deployment("grpo-pipeline/pipeline", parameters={"config": config}, timeout=0)
    run = _wait(client, run.id)
    assert run.state.is_completed(), run.state.message
    summary = RunRoot(str(root / "pg-run")).read_json("summary.json")
    assert summary["status"] == "completed" and summary["steps"] == 4

    # read back through the API: the server answers from PostgreSQL
    again = client.read_flow_run(run.id)
    assert again.parameters["config"] == config and again.state.is_completed()
    dep = client.read_deployment_by_name("grpo-pipeline/pipeline")
    assert again.deployment_id == dep.id
    # and the same row, straight from the database
    [(state, params, dep_id)] = postgres.query(
        "select state_type, parameters, deployment_id from flow_run where id = $1", run.id
    )
    assert state == "COMPLETED" and dep_id == dep.id
    assert json.loads(params)["config"] == config
