"""Deployments as production runs them: `prefect server start` on PostgreSQL, not SQLite.

A throwaway PostgreSQL cluster on 127.0.0.1 (tests/postgres.py: Debian's server binaries, skipped
without them), the Prefect server pointed at its `prefect` database with
PREFECT_API_DATABASE_CONNECTION_URL (it creates its tables on start), basic auth as in
test_deployments, `grpo serve` serving the deployments, and one run started through the API that
completes, its parameters and final state read back through the API and straight from PostgreSQL.
The server is stopped before the cluster, and must exit on SIGTERM by itself.
"""

import json
import signal
import subprocess

import pytest

from grpo_core.store.root import RunRoot
from tests.postgres import postgres  # noqa: F401 - the fixture
from tests.test_deployments import AUTH, BIN, _get, _stop, _wait, client_env, served_client, start_server, tiny

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pg_server(postgres, tmp_path_factory):  # noqa: F811 - the fixture imported above
    home = tmp_path_factory.mktemp("prefect-home-pg")
    try:
        proc, url = start_server(home, PREFECT_API_DATABASE_CONNECTION_URL=postgres.url)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{postgres.log()}") from None
    log = home / "server.log"
    try:
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
    proc = subprocess.Popen(
        [f"{BIN}/grpo", "serve", "--allow-root", str(root)],  # the default config's storage.root is ./runs
        env=client_env(home, url),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        with served_client(url, proc) as client:
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
