"""The Prefect API server a local `grpo run` (demo, eval, export) starts when no PREFECT_API_URL is
set: the server Prefect would start on its own in that case (its app, its database under
PREFECT_HOME, no UI), but owned by the CLI, so that

- Ctrl-C in the terminal does not reach it (it runs in a session of its own): the interrupted
  run can still record its state and write its summary, and the CLI exits in seconds instead of
  retrying API calls against a dead server;
- it ends with the CLI however the CLI ends, kill -9 included: it exits when its stdin, whose
  write end only the CLI holds, reaches end of file.

A notebook's kernel (flows.notebook) starts one at its first run and keeps it for the later ones
(kernel_server): a kernel interrupt does not reach it either, and it ends with the kernel.

`python -m flows.local_server PORT` is the server process itself.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

import uvicorn
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    get_current_settings,
    temporary_settings,
)

from grpo_core.launch.processes import free_port


@contextlib.contextmanager
def embedded_server(startup_timeout_s: float | None = None) -> Iterator[str | None]:
    """Start the server unless PREFECT_API_URL names one, and point Prefect at it while the
    block runs. Yields its API URL (None when the configured server is used)."""
    if PREFECT_API_URL.value():
        yield None
        return
    proc, url = start_server(startup_timeout_s)
    try:
        print(f"Prefect server for this run (stops with it): {url} (pid {proc.pid})", file=sys.stderr, flush=True)
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        stop_server(proc)


_KERNEL: dict[str, Any] = {}  # the server of this process's runs (kernel_server): its process and URL
_KERNEL_LOCK = threading.Lock()


def kernel_server(startup_timeout_s: float | None = None) -> str | None:
    """The API URL of a server that serves every run of this process (a notebook's kernel: started
    at its first run, reused by the later ones, stopped when the process exits however it exits);
    None when PREFECT_API_URL names a server. Callers point Prefect at it for each run
    (temporary_settings): a setting made in one notebook cell does not reach the next one."""
    if PREFECT_API_URL.value():
        return None
    with _KERNEL_LOCK:
        proc = _KERNEL.get("proc")
        if proc is None or proc.poll() is not None:
            proc, url = start_server(startup_timeout_s)
            _KERNEL.update(proc=proc, url=url)
            atexit.register(stop_server, proc)
            print(f"Prefect server for this kernel's runs: {url} (pid {proc.pid})", file=sys.stderr, flush=True)
        return _KERNEL["url"]


def start_server(startup_timeout_s: float | None = None) -> tuple[subprocess.Popen, str]:
    """The server process, answering at the returned API URL; it exits at the end of its stdin."""
    timeout = startup_timeout_s or float(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    port = free_port()
    env = {
        **os.environ,
        **get_current_settings().to_environment_variables(exclude_unset=True),
        # what Prefect sets for its own embedded server: no UI, the ephemeral server's services
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    with tempfile.TemporaryFile() as log:  # the server keeps its own handle on the file
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.local_server", str(port)],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env=env,
        )
        url = f"http://127.0.0.1:{port}/api"
        try:
            _wait_healthy(proc, url, timeout, log)
        except BaseException:
            stop_server(proc)
            raise
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    """Send what Prefect still queues for the server, then stop it."""
    _drain_prefect_clients()
    proc.stdin.close()  # the server exits at end of file; terminate() in case it is stuck
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _drain_prefect_clients(timeout_s: float = 5.0) -> None:
    """Send the logs and events Prefect still queues in the background while the server is up:
    stopped first, Prefect's workers retried against it for over a minute at exit."""
    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=timeout_s)
        except Exception:  # noqa: BLE001 - best effort: the run's outputs are already in the run root
            pass


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the embedded Prefect server exited with code {proc.returncode}: {_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(
        f"the embedded Prefect server did not answer at {url} within {timeout_s:g} s "
        f"(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS sets the limit): {_tail(log)}"
    )


def _tail(log) -> str:
    log.seek(0)
    text = log.read().decode(errors="replace").strip()
    return text[-1500:] or "(no output)"


def _exit_at_end_of_stdin() -> None:
    try:
        while os.read(0, 4096):  # the raw fd: a daemon thread inside sys.stdin's lock aborts interpreter exit
            pass
    except (OSError, ValueError):
        pass
    os._exit(0)  # SQLite's journal keeps the database whole


def main(port: int) -> None:
    threading.Thread(target=_exit_at_end_of_stdin, daemon=True, name="parent-watch").start()
    uvicorn.run(
        "prefect.server.api.server:create_app",
        factory=True,
        host="127.0.0.1",
        port=port,
        log_level="error",
        lifespan="on",
    )


if __name__ == "__main__":
    main(int(sys.argv[1]))
