"""The test process's real Prefect API server: one `prefect server start` on 127.0.0.1 with basic
auth, as an operator runs it, started once (10-40 s on this machine, ~10 CPU-s) and shared by
every module that needs a Prefect API:

- `prefect_server`: the in-process flows (and the `grpo` CLIs their tests start) run against it.
- `server`: the deployment modules (`grpo serve`, `prefect deploy`, workers); each module gets it
  emptied of what the modules before it left (flow runs, deployments and their concurrency
  slots, work pools), and empties it again when it ends.

Between the modules that use it, the server is paused (SIGSTOP to its process group, SIGCONT
when the next one starts): idle, its services still poll (2-4 % of a core). Its scheduler keeps
Prefect's 60-s loop: a deployment a test registers is scheduled by the loop for recently updated
ones (every 5 s); a 2-s main loop cost ~1.4 CPU-s a minute more. A second server for the
in-process flows (Prefect's test harness) cost each test process another start and its idle
polling for the whole run (~20 CPU-s).

Prefect reads its settings at import, so the environment is set when this plugin is imported
(tests/conftest.py names it): a throwaway PREFECT_HOME, no telemetry, a generous start-up
timeout. Each server runs in a subprocess on 127.0.0.1 with a temporary SQLite database and is
stopped by its own handle when the session ends.
"""

import atexit
import contextlib
import inspect
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from base64 import b64encode

import pytest

_home = tempfile.mkdtemp(prefix="grpo-test-prefect-")
atexit.register(shutil.rmtree, _home, True)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # each test process of pytest-xdist a home of its own: two servers starting at once would
    # write one home's UI files together (the controller's, which they inherit, is never used)
    os.environ["PREFECT_HOME"] = _home
os.environ.setdefault("PREFECT_HOME", _home)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

# Load Prefect fully now, before any test runs: its first real use configures logging with
# dictConfig, which closes every existing handler, pytest's capture streams included.
import prefect.main  # noqa: E402,F401

AUTH = "grpo:test-secret"
BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def prefect_server(_session_server):
    """The session's server, resumed, as this process's Prefect API for the module: the
    in-process flows' settings, and the environment of the processes its tests start."""
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    url, _, _, proc = _session_server
    _signal(proc, signal.SIGCONT)
    with pytest.MonkeyPatch.context() as env:  # for the processes the module's tests start
        env.setenv("PREFECT_API_AUTH_STRING", AUTH)
        with temporary_settings({PREFECT_API_URL: url, PREFECT_API_AUTH_STRING: AUTH}):
            # and for threads a test starts, which begin with the process-global settings (as
            # Prefect's own test harness does it): without, a flow run in one used a server of its own
            with _temporary_global_settings_context(get_settings_context()):
                yield
            _drain()  # what the flows logged and emitted reaches the server before it pauses
    _signal(proc, signal.SIGSTOP)


def _drain() -> None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain():  # as Prefect's own test harness drains them
        with contextlib.suppress(RuntimeError):  # no log worker started
            result = APILogWorker.instance().drain()
            if inspect.isawaitable(result):
                await result
        result = EventsWorker.drain_all()
        if inspect.isawaitable(result):
            await result

    run_coro_as_sync(drain())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, auth: str | None) -> int:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError):  # not listening (yet)
        return 0


def start_server(home, **env: str) -> tuple[subprocess.Popen, str]:
    """`prefect server start` on a free 127.0.0.1 port with basic auth, its state in `home` (and
    its log in home/server.log), `env` added to its environment; returns once it answers."""
    port = _free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not (k.startswith("PREFECT_") and "_DATABASE_" in k)},
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_AUTH_STRING": AUTH,
        "PREFECT_API_LOG_RETRYABLE_ERRORS": "true",
        "PREFECT_SERVER_UI_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_API_URL": "",
        **env,
    }
    with open(home / "server.log", "wb") as log:  # the server's own account, for a failure's message
        proc = subprocess.Popen(
            [f"{BIN}/prefect", "server", "start", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 180
    while _get(f"{url}/health", AUTH) != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise AssertionError(f"prefect server did not start:\n{(home / 'server.log').read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    """Stop a server we started, with its children (it runs in its own process group)."""
    _signal(proc, signal.SIGCONT)  # a paused server (see `server`) would hold SIGTERM until continued
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def client_env(home, url: str) -> dict[str, str]:
    """The environment of a client of that server (grpo serve, a worker, the prefect CLI)."""
    return {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": url,
        "PREFECT_API_AUTH_STRING": AUTH,
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }


@contextlib.contextmanager
def api_client(url: str):
    """A synchronous Prefect client of the server at `url`."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url, PREFECT_API_AUTH_STRING: AUTH}):
        with get_client(sync_client=True) as client:
            yield client


def empty(url: str, keep_pools: set[str]) -> None:
    """Delete what tests leave on a server: every flow run, every deployment (with its scheduled
    runs and concurrency slot) and every work pool but `keep_pools` (the server's own)."""
    with api_client(url) as client:
        # the API's bulk deletes (at most 50 a request): one transaction each, not one per run
        while client.request("POST", "/deployments/bulk_delete", json={"limit": 50}).json()["deleted"]:
            pass
        for pool in client.read_work_pools():
            if pool.name not in keep_pools:
                client.delete_work_pool(pool.name)
        while client.request("POST", "/flow_runs/bulk_delete", json={"limit": 50}).json()["deleted"]:
            pass
        assert client.read_flow_runs(limit=1) == [] and client.read_deployments(limit=1) == []


def _signal(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


@pytest.fixture(scope="session")
def _session_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    proc, url = start_server(home)
    try:
        with api_client(url) as client:
            own_pools = {pool.name for pool in client.read_work_pools()}
        yield url, home, own_pools, proc
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def server(_session_server):
    """(url, PREFECT_HOME) of the session's `prefect server start`, as empty as a new one: no
    flow run, deployment or work pool of an earlier module's (those modules' `grpo serve` and
    workers are stopped by then: their fixtures end with their module). Paused after the module
    (see above): nothing talks to it meanwhile, whatever the module started against it has
    stopped."""
    url, home, own_pools, proc = _session_server
    _signal(proc, signal.SIGCONT)
    empty(url, own_pools)
    yield url, home
    empty(url, own_pools)
    _signal(proc, signal.SIGSTOP)
