"""Launch a worker process (or, through a launcher, one per host), stream its JSON-line events,
and enforce a hard time limit.

Prefect cannot interrupt blocking code in a thread, so a stage's time limit is enforced here:
each worker runs in its own process group and every group is stopped (SIGTERM, then SIGKILL)
when the limit passes, or as soon as one process of a multi-host set fails. The worker's exit code
says whether a retry can help (grpo_core.errors, the table the worker chose it from); the task's
retry_condition_fn reads it from StageError.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

from grpo_core.config.memory import host_memory_bytes
from grpo_core.errors import OUT_OF_MEMORY_LEVERS, ExitCode, RunInterrupted, is_retryable
from grpo_core.launch.launchers import Launched, LauncherConfig, drop_all_ahead, park, start


class StageError(RuntimeError):
    """A stage failed. `retryable` says whether running it again can help; `code`, the exit code
    that says why (grpo_core.errors.ExitCode: the worker's, or the readiness check's), which
    `grpo run` exits with; None where no code says more than a failure (1)."""

    def __init__(self, message: str, retryable: bool, code: int | None = None):
        super().__init__(message)
        self.retryable, self.code = retryable, code


GiB = 2**30

# Interrupting a run (grpo run's Ctrl-C / SIGTERM handler, flows.cli): the stage running now stops
# its workers gracefully (SIGTERM: they save at the next step boundary) and raises RunInterrupted.
_INTERRUPT = threading.Event()
_LIVE: dict[int, Launched] = {}  # by id(): a Launched is a dataclass, not hashable
STOP_GRACE_S = 10.0  # SIGTERM to SIGKILL; the worker's own grace (8 s) ends it first


def request_interrupt() -> bool:
    """Ask the running stage to stop; True if a worker set is running (it will stop within
    STOP_GRACE_S and its run_worker raise RunInterrupted), False if none is."""
    _INTERRUPT.set()
    drop_all_ahead()
    return bool(_LIVE)


def clear_interrupt() -> None:
    """Let stages run again in this process after an interrupt: a notebook's kernel outlives the
    run it interrupted (flows.notebook), where the CLI's process ends with it."""
    _INTERRUPT.clear()


# Callables that see every event of every worker this process watches, after the stage's own
# on_event: flows.notebook's progress bar. A listener that raises is left out of that event.
_LISTENERS: list[Callable[[dict[str, Any]], None]] = []


def add_listener(fn: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    """Call `fn(event)` for each worker event from now on; returns the function that stops it."""
    _LISTENERS.append(fn)
    return lambda: _LISTENERS.remove(fn) if fn in _LISTENERS else None


def _and_listeners(on_event: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def both(event: dict[str, Any]) -> None:
        on_event(event)
        for fn in list(_LISTENERS):
            try:
                fn(event)
            except Exception:  # noqa: BLE001 - a progress display must never stop a stage
                pass

    return both


def kill_live_workers() -> None:
    """SIGKILL every running worker set at once (a second Ctrl-C)."""
    drop_all_ahead()
    for launched in list(_LIVE.values()):
        launched.stop(grace_s=0.5)


STOP_REPORT_ENV = "GRPO_STOP_REPORT_S"  # how long a stopped run may take to report, default 60 s


def watch_the_stop(on_stuck: Callable[[float], None]) -> threading.Event:
    """After request_interrupt: a stopped run ends even when what it reports to cannot answer.

    The stage's watcher stops its workers within STOP_GRACE_S; if that watcher is itself blocked
    (on a Prefect API that does not answer: Prefect's client retries each call for about a
    minute, so a run stopped then took many minutes), the workers are stopped here, the same way
    (SIGTERM: they save a checkpoint at their step boundary). Then the flow has GRPO_STOP_REPORT_S
    seconds to write its summary and report its states; `on_stuck(seconds)` is called if it has
    not set the returned event by then (a daemon thread, which that event ends)."""
    try:  # read in a signal handler: a bad value must not stop the stop
        report_s = max(1.0, float(os.environ.get(STOP_REPORT_ENV) or 60))
    except ValueError:
        report_s = 60.0
    ended = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + STOP_GRACE_S + 5
        while _LIVE and time.monotonic() < deadline and not ended.wait(0.2):
            pass
        for launched in list(_LIVE.values()):  # their watcher has not stopped them: do it here
            launched.stop(STOP_GRACE_S)
        if not ended.wait(report_s):
            on_stuck(report_s)

    threading.Thread(target=watch, name="grpo-stop-watch", daemon=True).start()
    return ended


class MemoryWatch:
    """The resident memory of the local worker processes, sampled about once a second, and the
    kernel's count of out-of-memory kills, so that a worker the kernel killed for memory is
    reported as such (a retry with the same settings would be killed again) and not as a crash."""

    def __init__(self, pids: list[int]):
        self.pids, self.peak, self.last = pids, 0, 0
        self.limit = min([host_memory_bytes(pid) for pid in pids] or [host_memory_bytes()])
        self.kills0 = _oom_kills()

    def sample(self) -> None:
        total = sum(_rss(pid) for pid in self.pids)
        if total:
            self.last, self.peak = total, max(self.peak, total)
            # read each time: a worker may move to a cgroup of its own after it starts
            self.limit = min([self.limit] + [host_memory_bytes(pid) for pid in self.pids])

    def killed_for_memory(self, rc: int) -> bool:
        """SIGKILL with the kernel's OOM-kill count up since start, or near the limit when last seen."""
        return rc == -9 and (_oom_kills() > self.kills0 or self.peak >= 0.8 * self.limit)

    def message(self, what: str, plan: dict[str, Any] | None) -> str:
        said = (
            f"; the memory plan said ~{plan['total_bytes'] / GiB:.2f} GiB ({plan.get('describe', '')})" if plan else ""
        )
        return (
            f"{what} ran out of memory: the kernel killed it (SIGKILL) at {self.peak / GiB:.2f} GiB resident "
            f"of {self.limit / GiB:.2f} GiB{said}. To fit: {OUT_OF_MEMORY_LEVERS}"
        )


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * 4096
    except (OSError, ValueError, IndexError):
        return 0


def _oom_kills() -> int:
    """The kernel's running count of OOM kills, machine-wide (/proc/vmstat; cgroup v2's memory.events
    where vmstat lacks it): a worker killed in a cgroup of its own counts too."""
    for path, key in (("/proc/vmstat", "oom_kill"), ("/sys/fs/cgroup/memory.events", "oom_kill")):
        try:
            with open(path) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == key:
                        return int(value)
        except (OSError, ValueError):
            continue
    return 0


def ahead_scope() -> str:
    """Whose worker started ahead a stage may take or stop: the flow run's (launchers.start_ahead).
    Two flow runs in one process (grpo serve --limit 2, the suite's threads) keep theirs apart."""
    from prefect.runtime import flow_run  # the Prefect side: read where a task runs

    return str(flow_run.id or "")


def run_worker(
    args: list[str],
    *,
    timeout_s: float,
    on_event: Callable[[dict[str, Any]], None],
    what: str,
    env: dict[str, str] | None = None,
    python: str | None = None,
    launcher: LauncherConfig | None = None,
    timeout_field: str = "pipeline.*_timeout_s",
    next_stage: bool = False,
) -> list[dict[str, Any]]:
    """Run `python -m <args>` (`python`: another interpreter, e.g. the sglang-jax environment's;
    default this one) through `launcher` (grpo_core.launch.launchers; default: one local process); call
    on_event for each JSON line of process 0; return all events. `next_stage`: another worker
    stage follows this one, so a local worker stays for it (grpo_core.stages.ahead): once the
    stage ended well the process is kept (launchers.park) with its backend up and its programs
    compiled, and the next stage runs in it.

    Every process of the set is watched: when one fails, the others would wait for it inside a
    collective until their heartbeat timeout, so the whole set is stopped at once.

    Raises StageError: not retryable for the worker's config/data/reward/divergence exits,
    retryable for crashes, kills, storage errors and the time limit."""
    if _INTERRUPT.is_set():
        raise RunInterrupted(f"{what} not started: the run was interrupted")
    scope = ahead_scope()
    on_event = _and_listeners(on_event)
    launched = start(launcher, args, env, python, stay=next_stage, scope=scope)  # only a local worker stays
    _LIVE[id(launched)] = launched
    stayed = False
    try:
        events, stayed = _watch(launched, timeout_s=timeout_s, on_event=on_event, what=what, field=timeout_field)
        return events
    finally:
        _LIVE.pop(id(launched), None)
        if stayed and not _INTERRUPT.is_set():
            park(launched, scope)  # the next stage's worker
        elif any(p.poll() is None for p in launched.procs):  # an exception on the way out: never leave them
            launched.stop(STOP_GRACE_S)


# Each worker process's output, read by threads started once per process: a process that stays
# for the next stage (grpo_core.stages.ahead) is watched again by that stage, from where it was.
_STREAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Streams:
    """A process's stdout lines (a queue; None once it closed) and the tail of its stderr."""

    def __init__(self, proc, report: bool):
        self.lines: queue.Queue = queue.Queue()
        self.tail: deque[str] = deque(maxlen=40)
        put = self.lines.put if report else (lambda _line: None)  # only process 0 reports
        self.threads = [
            threading.Thread(target=_pump, args=(proc.stdout, put, report), daemon=True),
            threading.Thread(target=_pump, args=(proc.stderr, self.tail.append), daemon=True),
        ]
        for t in self.threads:
            t.start()


def _streams(proc, report: bool) -> _Streams:
    found = _STREAMS.get(proc)
    if found is None:
        found = _STREAMS[proc] = _Streams(proc, report)
    else:
        found.tail.clear()  # the stage before's output is not this stage's
    return found


def _watch(
    launched: Launched, *, timeout_s: float, on_event, what: str, field: str
) -> tuple[list[dict[str, Any]], bool]:
    """The stage's events, and whether its worker stayed for the next stage (it printed
    stage_end and waits; it has not exited)."""
    procs = launched.procs
    streams = [_streams(p, i == 0) for i, p in enumerate(procs)]
    lines, tails = streams[0].lines, [s.tail for s in streams]
    deadline = time.monotonic() + timeout_s
    watch = MemoryWatch([p.pid for p in procs])
    events: list[dict[str, Any]] = []
    timed_out, streaming, failed, interrupted = False, True, None, False
    while True:
        try:
            line = lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            line = ""
        if line is None:  # process 0's stdout closed: it is exiting
            streaming = False
        else:
            event = _parse(line)
            if event is not None and event["event"] == "stage_end":
                return events, True  # done, and waiting for the next stage
            if event is not None:
                events.append(event)
                on_event(event)
        watch.sample()
        if _INTERRUPT.is_set():
            interrupted = True
            launched.stop(STOP_GRACE_S)
            break
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
    for s in streams:
        s.threads[1].join(timeout=5)
    if streaming and not interrupted:
        # A worker that failed is seen exiting before its last lines are read: its error event
        # is still in the pipe or the queue. They are read up to the end of its output (bounded:
        # a child of the worker may hold the pipe open).
        drain_until = time.monotonic() + 5.0
        while (left := drain_until - time.monotonic()) > 0 and (line := _next_line(lines, left)) is not None:
            if (event := _parse(line)) is not None and event["event"] != "stage_end":
                events.append(event)
                on_event(event)
    if interrupted:  # the events process 0 wrote while it stopped (its "interrupted" step)
        while (line := _next_line(lines, timeout_s=2.0)) is not None:
            if (event := _parse(line)) is not None:
                events.append(event)
                on_event(event)
        saved = [e["step"] for e in events if e.get("event") in ("checkpoint", "interrupted") and e.get("step")]
        where = f"checkpoint {max(saved)}" if saved else "its last checkpoint"
        raise RunInterrupted(f"{what} was interrupted and its workers stopped; the next run resumes from {where}")
    if timed_out:
        raise StageError(
            f"{what} passed its time limit of {timeout_s:g} s ({field}) and was stopped; raise it with "
            f"--set {field}=SECONDS (the same field in the deployment's form); it resumes from its last "
            "checkpoint",
            retryable=True,
        )
    if failed is None:
        return events, False
    rc, who = codes[failed], f" ({launched.specs[failed].name} of {len(procs)})" if len(procs) > 1 else ""
    errors = [e for e in events if e.get("event") == "error"]
    detail = errors[-1]["message"] if errors and failed == 0 else _tail(tails[failed])
    if not is_retryable(rc):
        raise StageError(f"{what} failed{who} ({ExitCode(rc).kind}): {detail}", retryable=False, code=rc)
    if watch.killed_for_memory(rc):
        plan = next((e for e in reversed(events) if e.get("event") == "memory"), None)
        raise StageError(watch.message(f"{what}{who}", plan), retryable=False, code=ExitCode.MEMORY)
    if rc == ExitCode.INTERRUPTED:  # SIGTERM from something else than this process: resumable
        stopped = next((e for e in reversed(events) if e.get("event") == "interrupted"), {})
        raise StageError(f"{what}{who} was stopped: {stopped.get('message', detail)}", retryable=True, code=rc)
    if rc < 0:  # its last output is not the cause of a kill: name the signal, then show the output as such
        raise StageError(f"{what}{who} was killed by {_signal_cause(-rc)}; its last output: {detail}", retryable=True)
    raise StageError(f"{what}{who} exited with code {rc}: {detail}", retryable=True, code=rc if rc > 0 else None)


def _signal_cause(sig: int) -> str:
    """A signal's name and what usually sends it to a worker."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
    why = {
        "SIGKILL": "the kernel's out-of-memory killer, a scheduler or someone's kill -9",
        "SIGTERM": "a scheduler or a shutdown",
        "SIGSEGV": "a crash in native code (XLA, a library)",
        "SIGABRT": "an abort in native code",
    }.get(name)
    return f"signal {sig} ({name}" + (f": {why})" if why else ")")


def _next_line(lines: queue.Queue, timeout_s: float) -> str | None:
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        return None


def _pump(stream, put, end_marker: bool = False) -> None:
    try:
        for line in stream:
            put(line.rstrip("\n"))
    except (OSError, ValueError):  # closed by the launcher (a worker started ahead, stopped)
        pass
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
