"""A run root's lease (grpo_core.store.lease) on real storage: a local folder and gs:// through the
GCS emulator (tests/gcs.py), with real threads and processes racing for it."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from grpo_core.errors import ConfigError, RunRootInUse
from grpo_core.store.lease import LEASE, LeaseHeld, LeaseLost, RunLease, process_alive, process_start
from grpo_core.store.root import RunRoot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(params=["local", "gs"])
def run_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "runs" / "r1")
    return request.getfixturevalue("gcs_emulator").url_for("runs") + "/r1"


def _files(url: str) -> dict[str, bytes]:
    """Every object under the run root, with its bytes."""
    root = RunRoot(url)
    root.fs.invalidate_cache()
    try:
        names = root.fs.find(root.path)
    except FileNotFoundError:
        return {}
    return {n[len(root.path) + 1 :]: root.fs.cat_file(n) for n in names}


def test_a_second_run_is_refused_naming_the_owner_and_writing_nothing(run_url):
    with RunLease(run_url, ttl_s=60, flow_run_id="flow-a") as a:
        before = _files(run_url)
        assert list(before) == [LEASE]
        rec = json.loads(before[LEASE])
        assert rec["owner"] == a.token and rec["pid"] == os.getpid() and rec["flow_run_id"] == "flow-a"
        assert rec["ttl_s"] == 60 and rec["heartbeat_at"] == rec["acquired_at"] and rec["run_url"] == a.url

        b = RunLease(run_url, ttl_s=60, flow_run_id="flow-b")
        for attempt in (b.acquire, b.raise_if_held):
            with pytest.raises(LeaseHeld) as err:
                attempt()
            msg = str(err.value)
            assert msg.startswith(f"run root {a.url} is in use by another run: host {rec['host']}, pid {os.getpid()}, ")
            assert "flow run flow-a" in msg and re.search(rf"\(its lease {re.escape(a.uri)}, taken [01] s ago\)", msg)
            assert re.search(r"Its heartbeat is [01] s old; unless renewed the lease expires in (59|60) s, at ", msg)
            assert "UTC (ttl 60 s)" in msg and "give this run another run_name or storage.root" in msg
        assert _files(run_url) == before  # the refused run wrote nothing
        assert not b.held and b.release() is False and a.held

        # Not a failure a retry can fix: the flow's tasks and the flow do not retry it.
        from tasks.stages import can_retry

        assert isinstance(err.value, RunRootInUse) and isinstance(err.value, ConfigError)
        assert not can_retry(err.value)
    assert _files(run_url) == {}  # released on leaving the block


def test_the_heartbeat_keeps_a_live_lease_beyond_its_ttl(run_url):
    with RunLease(run_url, ttl_s=2.0) as a:  # renewed every 0.5 s
        time.sleep(4.5)
        with pytest.raises(LeaseHeld):
            RunLease(run_url, ttl_s=2.0).acquire()
        rec = a.current()
        assert rec["owner"] == a.token and rec["renewals"] >= 4 and time.time() - rec["heartbeat_at"] < 2.0
        assert rec["acquired_at"] < rec["heartbeat_at"] and rec["expires_at"] == rec["heartbeat_at"] + 2.0
        a.check()


def test_an_expired_lease_is_taken_over_and_its_old_owner_finds_out(run_url, caplog):
    a = RunLease(run_url, ttl_s=1.0).acquire()
    a._stop_heartbeat()  # a hung owner: alive (this process), no longer renewing
    with pytest.raises(LeaseHeld, match="expires in [01] s"):
        RunLease(run_url, ttl_s=30).acquire()
    time.sleep(1.3)
    caplog.set_level(logging.WARNING, logger="grpo_core.store.lease")
    with RunLease(run_url, ttl_s=30, flow_run_id="flow-b") as b:
        assert any("took over the run root" in r.message and "past its ttl of 1 s" in r.message for r in caplog.records)
        with pytest.raises(LeaseLost) as err:
            a.check()
        assert str(err.value).startswith(f"run root {a.url} is no longer this run's: it was taken over by host ")
        assert "flow run flow-b" in str(err.value) and not a.held and a.lost
        assert any(r.levelno == logging.ERROR and r.message.startswith("LEASE LOST: ") for r in caplog.records)
        with pytest.raises(LeaseLost):
            a.renew()
        assert a.release() is False and b.current()["owner"] == b.token  # the old owner leaves it alone
        b.check()
    assert _files(run_url) == {}


def test_the_heartbeat_notices_a_takeover_by_itself(run_url, caplog):
    caplog.set_level(logging.ERROR, logger="grpo_core.store.lease")
    a = RunLease(run_url, ttl_s=0.8, flow_run_id="flow-1").acquire()
    with RunLease(run_url, ttl_s=30, flow_run_id="flow-1") as retry:  # a retry of the same flow run: at once
        deadline = time.time() + 5
        while a.lost is None and time.time() < deadline:
            time.sleep(0.05)
        assert a.lost and "taken over by" in a.lost and not a.held
        assert [r.message for r in caplog.records if r.message.startswith("LEASE LOST")]
        assert retry.current()["owner"] == retry.token  # the old holder's heartbeat stopped writing
        assert a.release() is False
    assert _files(run_url) == {}


def test_release_deletes_only_our_own_lease(run_url):
    a = RunLease(run_url, ttl_s=30, flow_run_id="f").acquire()
    assert a.release() is True and _files(run_url) == {} and a.release() is False
    a2 = RunLease(run_url, ttl_s=30, flow_run_id="f").acquire()
    b = RunLease(run_url, ttl_s=30, flow_run_id="f").acquire()  # takes a2's over
    assert a2.release() is False and b.current()["owner"] == b.token
    assert b.release() is True and _files(run_url) == {}


def test_a_context_releases_on_failure(run_url):
    with pytest.raises(ZeroDivisionError):
        with RunLease(run_url, ttl_s=30):
            1 / 0
    assert _files(run_url) == {}
    RunLease(run_url, ttl_s=30).acquire().release()


def test_an_unreadable_lease_is_never_taken_over(run_url):
    a = RunLease(run_url, ttl_s=30).acquire()
    RunRoot(run_url).write_bytes(LEASE, b'{"owner": "x"}')  # written over by hand
    with pytest.raises(LeaseHeld, match=r"has a lease this program cannot read \(.*lease.json: no host, pid"):
        RunLease(run_url).acquire()
    with pytest.raises(LeaseLost, match="its lease was overwritten: "):
        a.check()
    assert a.release() is False and RunRoot(run_url).read_bytes(LEASE) == b'{"owner": "x"}'


_HOLDER = """
import os, sys, time
from grpo_core.store.lease import LeaseHeld, RunLease
lease = RunLease(sys.argv[1], ttl_s=float(sys.argv[2]))
print("ready", flush=True)
while not os.path.exists(sys.argv[3]):
    time.sleep(0.002)
try:
    lease.acquire()
except LeaseHeld:
    print("refused", flush=True)
    sys.exit(0)
print("won", flush=True)
sys.stdin.read()  # hold it until the test closes stdin
print("released" if lease.release() else "not released", flush=True)
"""


def _holders(url: str, n: int, ttl_s: float, go: str) -> list[subprocess.Popen]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _HOLDER, url, str(ttl_s), go],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    return procs


def test_a_dead_local_owner_is_taken_over_at_once(run_url, tmp_path):
    go = tmp_path / "go"
    go.touch()
    (holder,) = _holders(run_url, 1, 600, str(go))
    try:
        assert holder.stdout.readline().strip() == "won"
        rec = RunLease(run_url).current()
        assert rec["pid"] == holder.pid and rec["pid_start"] == process_start(holder.pid)
        with pytest.raises(LeaseHeld, match=f"pid {holder.pid}, "):  # alive: its heartbeat is fresh
            RunLease(run_url).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
    time.sleep(0.2)  # not reaped yet: a zombie is no owner either
    assert not process_alive(rec["pid"], rec["pid_start"])
    with RunLease(run_url, ttl_s=30) as b:  # no wait for its ttl of 600 s
        assert b.current()["owner"] == b.token
    holder.wait()


def test_a_reused_pid_is_not_the_owner(run_url):
    # A lease whose pid is alive on this host but started at another time: the pid was reused.
    a = RunLease(run_url, ttl_s=600).acquire()
    a._stop_heartbeat()
    rec = dict(a.current(), pid_start="1")
    RunRoot(run_url).write_bytes(LEASE, json.dumps(rec).encode())
    assert process_alive(os.getpid(), process_start(os.getpid())) and not process_alive(os.getpid(), "1")
    with RunLease(run_url, ttl_s=30) as b:
        assert b.current()["owner"] == b.token
    with pytest.raises(LeaseLost):
        a.check()


def _race(url: str, n: int) -> tuple[list[RunLease], list[BaseException]]:
    contenders = [RunLease(url, ttl_s=30, flow_run_id=f"flow-{i}") for i in range(n)]
    barrier, won, refused, other = threading.Barrier(n), [], [], []

    def go(lease: RunLease) -> None:
        barrier.wait()
        try:
            won.append(lease.acquire())
        except LeaseHeld as exc:
            refused.append(exc)
        except BaseException as exc:  # noqa: BLE001 - reported below
            other.append(exc)

    threads = [threading.Thread(target=go, args=(c,)) for c in contenders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert other == [] and len(won) + len(refused) == n
    return won, refused


def test_threads_racing_for_a_free_lease_one_wins(run_url):
    won, refused = _race(run_url, 8)
    assert len(won) == 1 and len(refused) == 7
    assert json.loads(_files(run_url)[LEASE])["owner"] == won[0].token
    won[0].release()


def test_threads_racing_to_take_over_an_expired_lease_one_wins(run_url):
    old = RunLease(run_url, ttl_s=0.5).acquire()
    old._stop_heartbeat()
    time.sleep(0.7)
    won, refused = _race(run_url, 8)
    assert len(won) == 1 and len(refused) == 7
    assert json.loads(_files(run_url)[LEASE])["owner"] == won[0].token
    with pytest.raises(LeaseLost):
        old.check()
    won[0].release()


@pytest.mark.slow
def test_processes_racing_for_a_lease_one_wins(run_url, tmp_path):
    go = tmp_path / f"go-{uuid.uuid4().hex[:6]}"
    procs = _holders(run_url, 6, 30, str(go))
    try:
        go.touch()
        results = [p.stdout.readline().strip() for p in procs]
        assert sorted(results) == ["refused"] * 5 + ["won"]
        winner = procs[results.index("won")]
        assert RunLease(run_url).current()["pid"] == winner.pid
        winner.stdin.close()
        assert winner.stdout.readline().strip() == "released"
    finally:
        for p in procs:
            if not p.stdin.closed:
                p.stdin.close()
            p.wait(30)
    assert _files(run_url) == {}


def _flow_run(state):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(state.state_details.flow_run_id)


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_a_pipeline_is_refused_at_once_while_another_run_holds_its_root(tmp_path):
    from flows.pipeline import grpo_pipeline
    from tests.test_pipeline import small_config, task_runs

    cfg = small_config(str(tmp_path), "busy")
    with RunLease(str(tmp_path / "busy"), ttl_s=60, flow_run_id="other-flow") as other:
        before = _files(other.url)
        t = time.perf_counter()
        state = grpo_pipeline.with_options(retries=1)(cfg, return_state=True)  # a flow retry would refuse too
        assert state.is_failed() and time.perf_counter() - t < 30
        with pytest.raises(LeaseHeld) as err:
            state.result()
        assert str(err.value).startswith(f"run root {other.url} is in use by another run: host ")
        assert "flow run other-flow" in str(err.value)
        assert _files(other.url) == before  # not even config.json: nothing of the refused run
        assert _flow_run(state).run_count == 1 and task_runs(state) == {}  # no flow retry, no task
    assert _files(other.url) == {}


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_two_pipelines_on_one_root_the_second_is_refused(tmp_path):
    """A real run holds its root for its whole flow and releases it at the end; a second pipeline
    started meanwhile (in another thread) fails at once with the refusal."""
    from flows.pipeline import grpo_pipeline
    from tests.test_pipeline import NUM_STEPS, small_config

    cfg = small_config(str(tmp_path), "shared", pipeline={"epochs": 1, "export": False})
    lease_file = tmp_path / "shared" / LEASE
    second: dict = {}

    def start_second_run() -> None:
        deadline = time.time() + 300
        while not lease_file.exists() and time.time() < deadline:
            time.sleep(0.05)
        second["owner"] = json.loads(lease_file.read_text())
        t = time.perf_counter()
        second["state"] = grpo_pipeline.with_options(retries=0)(cfg, return_state=True)
        second["s"] = time.perf_counter() - t
        second["still_held"] = lease_file.exists()

    thread = threading.Thread(target=start_second_run)
    thread.start()
    first = grpo_pipeline.with_options(retries=0)(cfg, return_state=True)
    thread.join(60)
    assert first.is_completed() and first.result()["steps"] == NUM_STEPS
    assert not lease_file.exists()  # released at the end

    state = second["state"]
    assert state.is_failed() and second["s"] < 30 and second["still_held"]
    with pytest.raises(LeaseHeld) as err:
        state.result()
    owner = second["owner"]
    assert owner["flow_run_id"] == str(first.state_details.flow_run_id) and owner["pid"] == os.getpid()
    assert f"flow run {owner['flow_run_id']}" in str(err.value)
    summary = RunRoot(str(tmp_path / "shared")).read_json("summary.json")
    assert summary["status"] == "completed"  # the refused run wrote no summary over it


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_two_pipelines_in_one_process_keep_their_workers_started_ahead_apart(tmp_path):
    """Two flow runs in one process (grpo serve --limit 2; a readiness and a pipeline deployment
    at once) on different roots: each one's worker started ahead is its own, so one run's end
    (drop_ahead) never stops the other's (a shared one closed the other's pipes: 'I/O operation
    on closed file' in its readiness checks). Both complete with their steps and exports."""
    from flows.pipeline import grpo_pipeline
    from grpo_core.launch import launchers
    from tests.test_pipeline import NUM_STEPS, small_config

    cfgs = [small_config(str(tmp_path / root), "run", pipeline={"epochs": 1}) for root in ("a", "b")]
    states: dict[int, object] = {}

    def run(i: int) -> None:
        states[i] = grpo_pipeline.with_options(retries=0)(cfgs[i], return_state=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for i in range(2):
        state = states[i]
        assert state.is_completed(), state.message
        assert state.result()["steps"] == NUM_STEPS
        assert RunRoot(state.result()["export_uri"]).exists("config.json")
    assert not launchers._AHEAD  # each run dropped its own, nothing is left waiting


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_a_pipeline_whose_root_is_taken_over_stops_without_writing_more(tmp_path):
    from flows.pipeline import grpo_pipeline
    from tests.test_pipeline import small_config

    cfg = small_config(str(tmp_path), "taken", pipeline={"epochs": 1, "export": False})
    lease_file = tmp_path / "taken" / LEASE
    intruder: dict = {}

    def take_over() -> None:  # what a retry of the same flow run, on another machine, would do
        deadline = time.time() + 300
        while not lease_file.exists() and time.time() < deadline:
            time.sleep(0.02)
        owner = json.loads(lease_file.read_text())
        intruder["lease"] = RunLease(str(tmp_path / "taken"), ttl_s=60, flow_run_id=owner["flow_run_id"]).acquire()

    thread = threading.Thread(target=take_over)
    thread.start()
    state = grpo_pipeline.with_options(retries=1)(cfg, return_state=True)
    thread.join(60)
    lease = intruder["lease"]
    try:
        assert state.is_failed()
        with pytest.raises(LeaseLost, match=r"is no longer this run's: it was taken over by host "):
            state.result()
        assert _flow_run(state).run_count == 1  # not retried
        run = RunRoot(lease.url)
        assert not run.exists("summary.json") and not run.exists("stages/train-epoch-0/_SUCCESS")
        assert lease.current()["owner"] == lease.token  # the stopped run left the new owner's lease alone
        lease.check()
    finally:
        lease.release()
