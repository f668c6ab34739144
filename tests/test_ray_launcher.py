"""The Ray launcher end to end (pipeline.launcher.kind: ray, address local): its driver starts a Ray
instance of its own and two host tasks on this one node (PACK), which run the training worker as a
two-process JAX group, as tests/test_multihost.py runs the multiprocess launcher: a run straight
through, a run whose process 1 is SIGKILLed after step 3 and its retry, which resumes from
checkpoint 2 to the same metrics and parameters; and a run stopped mid-way, as a time limit or an
interrupt stops one.

A local Ray instance may listen on any interface (which ones depends on Ray's version and
settings), so the driver (and with it everything Ray starts) runs in a network namespace of its
own (`unshare -n`: loopback only): the launcher's interpreter is a script that enters one.
Everything the driver starts is in its session; none of it may outlive the run. Skipped without
Ray or network namespaces.
"""

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import jax
import numpy as np
import pytest

import tasks.process
from grpo_core.launch.launchers import LauncherConfig
from grpo_core.rl.checkpoint import Checkpointer
from grpo_core.store.root import RunRoot
from tasks.process import StageError, run_worker
from tests.faults import HOOK
from tests.test_worker import make_run

pytest.importorskip("ray")  # the driver's; nothing here imports it

RAY = LauncherConfig(
    kind="ray",
    address="local",  # the driver's own instance, stopped when it exits
    num_processes=2,
    placement_strategy="PACK",  # both host tasks on this one node
    init_timeout_s=60,
    heartbeat_timeout_s=20,
)
MARK = "GRPO_RAY_TEST_MARK"  # in the environment of everything the test starts


def _netns_works() -> bool:
    try:
        argv = ["unshare", "-n", "sh", "-c", "ip link set lo up"]
        return subprocess.run(argv, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _procs(match) -> list[tuple[int, str, dict[str, str]]]:
    """(pid, command line, environment) of the live processes (zombies aside) for which
    match(session id, environment, command line) holds."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] == "Z":
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(x.split("=", 1) for x in f.read().decode(errors="replace").split("\0") if "=" in x)
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if match(int(fields[3]), env, cmd):
            found.append((int(name), cmd, env))
    return found


def _left(sid: int, mark: str, wait_s: float = 30.0) -> list[tuple[int, str, dict[str, str]]]:
    """What is left of a run (the driver's session, or anything carrying the test's mark) after up
    to wait_s for it to end; whatever is still there then is SIGKILLed, by pid, and returned."""
    mine = lambda s, env, cmd: s == sid or env.get(MARK) == mark
    deadline = time.monotonic() + wait_s
    while (left := _procs(mine)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid, _, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _params(root: str, step: int):
    with Checkpointer(RunRoot(root).uri("checkpoints")) as ckpt:
        state, meta = ckpt.restore(step)
    assert meta["step"] == step
    return state["params"]


class _StopError(Exception):
    pass


@pytest.mark.slow
@pytest.mark.skipif(not _netns_works(), reason="needs network namespaces (unshare -n) and ip")
def test_ray_launcher_trains_is_killed_resumes_and_stops_in_a_network_namespace(tmp_path, monkeypatch):
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    ray_tmp = tempfile.mkdtemp(prefix="grpo-ray-")  # short: Ray's socket paths must fit 107 bytes
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    python = tmp_path / "python-in-netns"  # the driver's interpreter: the same, in a namespace of its own
    python.write_text(
        f'#!/bin/sh\nexec unshare -n sh -c \'ip link set lo up && exec "$0" "$@"\' {shlex.quote(sys.executable)} "$@"\n'
    )
    python.chmod(0o755)
    drivers: list[int] = []
    real_start = tasks.process.start

    def start(*args, **kw):
        launched = real_start(*args, **kw)
        drivers.append(launched.procs[0].pid)  # its session: all that the driver and Ray start
        return launched

    monkeypatch.setattr(tasks.process, "start", start)
    own_netns = os.readlink("/proc/self/ns/net")
    seen_running: list[dict] = []

    def look(event):
        """At a run's start: the driver in a namespace of its own, two workers in its session."""
        if event["event"] in ("start", "resumed") and len(seen_running) < len(drivers):
            sid = drivers[-1]
            workers = _procs(lambda s, env, cmd: s == sid and "-m grpo_core.stages.worker" in cmd)
            seen_running.append(
                {
                    "netns": os.readlink(f"/proc/{sid}/ns/net"),
                    "workers": sorted((env["GRPO_PROCESS_ID"], env["GRPO_COORDINATOR"]) for _, _, env in workers),
                    "worker_netns": {os.readlink(f"/proc/{pid}/ns/net") for pid, _, _ in workers},
                }
            )

    def train(root, *, on_event=None, **kw):
        try:
            return run_worker(
                ["grpo_core.stages.worker", "train", "--root", root, "--until-step", "6"],
                timeout_s=300,
                what="training",
                launcher=RAY,
                python=str(python),
                on_event=lambda e: (look(e), on_event and on_event(e)),
                **kw,
            )
        finally:
            left = _left(drivers[-1], mark)
            assert not left, f"{len(left)} process(es) outlived the run: " + "; ".join(c[:120] for _, c, _ in left)

    try:
        # Uninterrupted: process 0's events come through the driver.
        straight = make_run(str(tmp_path), "straight")
        ev = train(straight)
        assert ev.pop(0)["event"] == "memory"  # the memory plan comes first
        assert ev[0] == {"event": "start", "step": 0, "until": 6}
        assert ev[-1] == {"event": "done", "step": 6, "steps_run": 6}
        assert [e["step"] for e in ev if e["event"] == "checkpoint"] == [2, 4, 6]
        assert RunRoot(straight).list("metrics") == [
            "00000000-00000001.jsonl",
            "00000002-00000003.jsonl",
            "00000004-00000005.jsonl",
        ]
        [running] = seen_running
        assert running["netns"] != own_netns and running["worker_netns"] == {running["netns"]}
        assert running["workers"] == [("0", "127.0.0.1:8476"), ("1", "127.0.0.1:8476")]

        # Process 1 is SIGKILLed after step 3 (checkpoint 2 is durable): the driver cancels process 0's
        # task and ends as process 1 did, so the task reads a kill, worth a retry.
        killed = make_run(str(tmp_path), "killed")
        seen: list[dict] = []
        env = {"GRPO_TEST_HOOK": HOOK, "GRPO_FAULT": f"step:3:{tmp_path / 'fault-fired'}", "GRPO_FAULT_PROCESS": "1"}
        with pytest.raises(StageError, match=r"training was killed by signal 9 \(SIGKILL: .*; its last output") as err:
            train(killed, on_event=seen.append, env=env)
        assert err.value.retryable
        assert "process 1 of 2 was killed by signal 9" in str(err.value), str(err.value)[-500:]
        assert (tmp_path / "fault-fired").exists()
        assert [e["step"] for e in seen if e["event"] == "checkpoint"] == [2]
        with Checkpointer(RunRoot(killed).uri("checkpoints")) as ckpt:
            assert ckpt.all_steps() == [2]

        ev = train(killed)  # the retry: resumes from 2
        assert (
            ev[0]["event"] == "memory"
            and ev[1] == {"event": "resumed", "step": 2, "until": 6}
            and ev[-1] == {"event": "done", "step": 6, "steps_run": 4}
        )
        a, b = RunRoot(straight).read_metrics(), RunRoot(killed).read_metrics()
        assert [r["step"] for r in b] == list(range(6))  # none lost, none twice
        for x, y in zip(a, b):  # the same program on the same inputs: the same numbers
            assert y["reward"] == x["reward"] and y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-7)
        jax.tree.map(
            lambda p, q: np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6),
            _params(straight, 6),
            _params(killed, 6),
        )

        # Stopped once it runs (what a time limit, an interrupt or a failure elsewhere does: SIGTERM to the
        # driver's process group, then SIGKILL): nothing of Ray or of the workers outlives it.
        def stop_at_start(e):
            if e["event"] == "start":
                raise _StopError

        with pytest.raises(_StopError):
            train(make_run(str(tmp_path), "stopped"), on_event=stop_at_start)
        assert len(seen_running) == 4 and all(r["netns"] != own_netns for r in seen_running)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
