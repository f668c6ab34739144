"""Launch a worker process (or, through a launcher, one per host), stream its JSON-line events,
and enforce a hard time limit.

Prefect cannot interrupt blocking code in a thread, so a stage's time limit is enforced here:
each worker runs in its own process group and every group is stopped (SIGTERM, then SIGKILL)
when the limit passes, or as soon as one process of a multi-host set fails. The worker's exit code says whether a retry can help
(grpo_core.worker.NOT_RETRYABLE); the task's retry_condition_fn reads it from StageError.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from typing import Any, Callable

from grpo_core.launch import LauncherConfig, start
from grpo_core.worker import EXIT_CONFIG, EXIT_DIVERGED, EXIT_REWARD, NOT_RETRYABLE


class StageError(RuntimeError):
    """A stage failed. `retryable` says whether running it again can help."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


_KIND_BY_CODE = {EXIT_CONFIG: "config or data error", EXIT_REWARD: "reward function error",
                 EXIT_DIVERGED: "training diverged"}


def run_worker(args: list[str], *, timeout_s: float, on_event: Callable[[dict[str, Any]], None],
               what: str, env: dict[str, str] | None = None, python: str | None = None,
               launcher: LauncherConfig | None = None) -> list[dict[str, Any]]:
    """Run `python -m <args>` (`python`: another interpreter, e.g. the sglang-jax environment's;
    default this one) through `launcher` (grpo_core.launch; default: one local process); call
    on_event for each JSON line of process 0; return all events.

    Every process of the set is watched: when one fails, the others would wait for it inside a
    collective until their heartbeat timeout, so the whole set is stopped at once.

    Raises StageError: not retryable for the worker's config/data/reward/divergence exits,
    retryable for crashes, kills, storage errors and the time limit."""
    launched = start(launcher, args, env, python)
    procs = launched.procs
    lines: queue.Queue = queue.Queue()
    tails: list[deque[str]] = [deque(maxlen=40) for _ in procs]
    threading.Thread(target=_pump, args=(procs[0].stdout, lines.put, True), daemon=True).start()
    for p in procs[1:]:  # only process 0 reports; the others' output is drained so a full pipe never blocks them
        threading.Thread(target=_pump, args=(p.stdout, lambda _line: None), daemon=True).start()
    err_threads = [threading.Thread(target=_pump, args=(p.stderr, tail.append), daemon=True) for p, tail in zip(procs, tails)]
    for t in err_threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    events: list[dict[str, Any]] = []
    timed_out, streaming, failed = False, True, None
    while True:
        try:
            line = lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            line = ""
        if line is None:  # process 0's stdout closed: it is exiting
            streaming = False
        else:
            event = _parse(line)
            if event is not None:
                events.append(event)
                on_event(event)
        failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
        if failed is not None:
            launched.stop()
            break
        if not streaming and all(p.poll() is not None for p in procs):
            break
        if time.monotonic() >= deadline:
            timed_out = True
            launched.stop()
            break
    codes = [p.wait() for p in procs]
    for t in err_threads:
        t.join(timeout=5)
    if timed_out:
        raise StageError(f"{what} passed its time limit of {timeout_s:g} s and was stopped "
                         f"(raise it with --set pipeline.*_timeout_s=...); it resumes from its last checkpoint",
                         retryable=True)
    if failed is None:
        return events
    rc, who = codes[failed], f" ({launched.specs[failed].name} of {len(procs)})" if len(procs) > 1 else ""
    errors = [e for e in events if e.get("event") == "error"]
    detail = errors[-1]["message"] if errors and failed == 0 else _tail(tails[failed])
    if rc in NOT_RETRYABLE:
        raise StageError(f"{what} failed{who} ({_KIND_BY_CODE[rc]}): {detail}", retryable=False)
    how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
    raise StageError(f"{what}{who} {how}: {detail}", retryable=True)


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


def _tail(lines: deque[str]) -> str:
    text = "\n".join(line for line in lines if line and not line.startswith('{"event": "exit"'))
    return text[-2000:] if text else "(no output)"
