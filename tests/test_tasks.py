"""Task plumbing against a real Prefect server: hard time limits that stop the worker's whole
process group, and retries only where a retry can help."""

import os
import time

import pytest
from prefect import flow, task

from tasks.process import StageError, run_worker
from tasks.stages import retryable


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited; it only waits to be reaped
        return f.read().split(")")[-1].split()[0] != "Z"


def test_time_limit_stops_the_worker_and_its_children():
    seen = []
    t = time.monotonic()
    with pytest.raises(StageError, match="passed its time limit of 2 s and was stopped") as err:
        run_worker(["tests.sleepy_worker", "sleep"], timeout_s=2, on_event=seen.append, what="sleepy")
    assert err.value.retryable and time.monotonic() - t < 30
    assert [e["event"] for e in seen] == ["start"]  # stray output is not an event
    deadline = time.monotonic() + 10
    while _alive(seen[0]["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(seen[0]["pid"])  # the grandchild went with the group


def test_exit_codes_decide_retryability():
    with pytest.raises(StageError, match=r"failed \(config or data error\): bad field x") as err:
        run_worker(["tests.sleepy_worker", "exit=2"], timeout_s=60, on_event=lambda e: None, what="w")
    assert not err.value.retryable
    with pytest.raises(StageError, match="exited with code 7") as err:
        run_worker(["tests.sleepy_worker", "exit=7"], timeout_s=60, on_event=lambda e: None, what="w")
    assert err.value.retryable


@pytest.mark.usefixtures("prefect_server")
def test_retry_condition_retries_only_what_can_succeed():
    calls = {"crash": 0, "config": 0}

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=retryable)
    def flaky(kind: str) -> str:
        calls[kind] += 1
        if kind == "crash" and calls[kind] < 3:
            raise StageError("worker was killed by signal 9", retryable=True)
        if kind == "config":
            raise StageError("failed (config or data error): x", retryable=False)
        return "ok"

    @flow
    def both():
        a = flaky("crash")
        try:
            flaky("config")
        except StageError:
            return a, "failed"
        return a, "passed"

    assert both() == ("ok", "failed")
    assert calls == {"crash": 3, "config": 1}
