"""Launch a worker process, stream its JSON-line events, and enforce a hard time limit.

Prefect cannot interrupt blocking code in a thread, so a stage's time limit is enforced here:
the worker runs in its own process group and the whole group is stopped (SIGTERM, then
SIGKILL) when the limit passes. The worker's exit code says whether a retry can help
(grpo_core.worker.NOT_RETRYABLE); the task's retry_condition_fn reads it from StageError.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any, Callable

from grpo_core.worker import EXIT_CONFIG, EXIT_DIVERGED, EXIT_REWARD, NOT_RETRYABLE


class StageError(RuntimeError):
    """A stage failed. `retryable` says whether running it again can help."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


_KIND_BY_CODE = {EXIT_CONFIG: "config or data error", EXIT_REWARD: "reward function error",
                 EXIT_DIVERGED: "training diverged"}


def run_worker(args: list[str], *, timeout_s: float, on_event: Callable[[dict[str, Any]], None],
               what: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run `python -m <args>`; call on_event for each JSON line; return all events.

    Raises StageError: not retryable for the worker's config/data/reward/divergence exits,
    retryable for crashes, kills, storage errors and the time limit."""
    proc = subprocess.Popen([sys.executable, "-m", *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, **(env or {})})
    lines: queue.Queue = queue.Queue()
    err_tail: deque[str] = deque(maxlen=40)
    threading.Thread(target=_pump, args=(proc.stdout, lines.put, True), daemon=True).start()
    err_thread = threading.Thread(target=_pump, args=(proc.stderr, err_tail.append), daemon=True)
    err_thread.start()
    deadline = time.monotonic() + timeout_s
    events: list[dict[str, Any]] = []
    timed_out = False
    while True:
        try:
            line = lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() >= deadline:
                timed_out = True
                _stop(proc)
                break
            continue
        if line is None:  # stdout closed: the worker is exiting
            break
        event = _parse(line)
        if event is not None:
            events.append(event)
            on_event(event)
    rc = proc.wait()
    err_thread.join(timeout=5)
    if timed_out:
        raise StageError(f"{what} passed its time limit of {timeout_s:g} s and was stopped "
                         f"(raise it with --set pipeline.*_timeout_s=...); it resumes from its last checkpoint",
                         retryable=True)
    if rc == 0:
        return events
    errors = [e for e in events if e.get("event") == "error"]
    detail = errors[-1]["message"] if errors else _tail(err_tail)
    if rc in NOT_RETRYABLE:
        raise StageError(f"{what} failed ({_KIND_BY_CODE[rc]}): {detail}", retryable=False)
    how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
    raise StageError(f"{what} {how}: {detail}", retryable=True)


def _pump(stream, put, end_marker: bool = False) -> None:
    for line in stream:
        put(line.rstrip("\n"))
    if end_marker:
        put(None)


def _parse(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None  # stray output (a library's print) is not an event
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) and "event" in event else None


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the worker's process group, then SIGKILL it if it has not exited."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(lines: deque[str]) -> str:
    text = "\n".join(line for line in lines if line and not line.startswith('{"event": "exit"'))
    return text[-2000:] if text else "(no output)"
