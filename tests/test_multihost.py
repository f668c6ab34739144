"""Multi-host JAX on one machine: N worker processes on 127.0.0.1 with CPU devices and gloo
collectives (grpo_core.launch.launchers kind multiprocess), as a TPU pod runs one per host. And the
launchers that cannot run here (Ray, TPU VMs): the exact commands they build."""

import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest

from grpo_core.launch import cluster as distributed
from grpo_core.launch.launchers import LauncherConfig, plan, start
from grpo_core.rl.checkpoint import Checkpointer
from grpo_core.store.root import RunRoot
from tasks.process import StageError, run_worker
from tests.test_worker import make_run

TWO = LauncherConfig(kind="multiprocess", num_processes=2, init_timeout_s=60, heartbeat_timeout_s=20)


def _train(root: str, until: int, launcher=TWO, **kw):
    return run_worker(
        ["grpo_core.stages.worker", "train", "--root", root, "--until-step", str(until)],
        timeout_s=240,
        what="training",
        launcher=launcher,
        **kw,
    )


def _params(root: str, step: int):
    with Checkpointer(RunRoot(root).uri("checkpoints")) as ckpt:
        state, meta = ckpt.restore(step)
    assert meta["step"] == step
    return state["params"]


@pytest.mark.slow
def test_two_processes_train_checkpoint_are_killed_and_resume(tmp_path):
    # Uninterrupted, both processes' output read here: process 0 reports, process 1 prints no event.
    straight = make_run(str(tmp_path), "straight")
    launched = start(TWO, ["grpo_core.stages.worker", "train", "--root", straight, "--until-step", "6"])
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda p: p.communicate(timeout=240), launched.procs))
    assert [p.returncode for p in launched.procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    ev = [json.loads(x) for x in outs[0][0].splitlines() if x.startswith("{")]
    assert ev.pop(0)["event"] == "memory"  # the memory plan comes first
    assert ev[0] == {"event": "start", "step": 0, "until": 6} and ev[-1] == {"event": "done", "step": 6, "steps_run": 6}
    assert [e["step"] for e in ev if e["event"] == "checkpoint"] == [2, 4, 6]
    assert not [x for x in outs[1][0].splitlines() if x.startswith("{")]
    assert RunRoot(straight).list("metrics") == [
        "00000000-00000001.jsonl",
        "00000002-00000003.jsonl",
        "00000004-00000005.jsonl",
    ]

    # Process 1 is SIGKILLed after step 3 (checkpoint 2 is durable): the watcher stops process 0,
    # which would otherwise wait in a collective until its heartbeat timeout.
    killed = make_run(str(tmp_path), "killed")
    seen = []
    from tests.faults import HOOK

    env = {"GRPO_TEST_HOOK": HOOK, "GRPO_FAULT": f"step:3:{tmp_path / 'fault-fired'}", "GRPO_FAULT_PROCESS": "1"}
    with pytest.raises(StageError, match=r"training \(process 1 of 2\) was killed by signal 9") as err:
        _train(killed, 6, on_event=seen.append, env=env)
    assert err.value.retryable
    assert [e["step"] for e in seen if e["event"] == "checkpoint"] == [2]
    with Checkpointer(RunRoot(killed).uri("checkpoints")) as ckpt:
        assert ckpt.all_steps() == [2]

    ev = _train(killed, 6, on_event=lambda e: None)  # the retry: resumes from 2
    assert (
        ev[0]["event"] == "memory"
        and ev[1] == {"event": "resumed", "step": 2, "until": 6}
        and ev[-1] == {"event": "done", "step": 6, "steps_run": 4}
    )
    a, b = RunRoot(straight).read_metrics(), RunRoot(killed).read_metrics()
    assert [r["step"] for r in b] == list(range(6))
    for x, y in zip(a, b):  # the same program on the same inputs: the same numbers
        assert y["reward"] == x["reward"] and y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-7)
    jax.tree.map(
        lambda p, q: np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6), _params(straight, 6), _params(killed, 6)
    )


_AGREE = """
import json, os
from grpo_core.launch import cluster as distributed
distributed.initialize(distributed.from_env())
i = distributed.process_index()
print(json.dumps({"event": "agree", "process": i,
                  "differ": distributed.disagreements({"same": "x", "mine": str(i), "odd": str(i % 2 == 1 and i)})}),
      flush=True)
"""


@pytest.mark.slow
def test_disagreements_name_the_processes(tmp_path):
    script = tmp_path / "agree.py"
    script.write_text(_AGREE)
    specs, _ = plan(LauncherConfig(kind="multiprocess", num_processes=3, init_timeout_s=60), ["unused"])
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**os.environ, **s.env},  # the launcher's environment
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for s in specs
    ]
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda p: p.communicate(timeout=120), procs))
    got = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    for g in got:  # every process learns the same: who differs from process 0
        assert g["differ"] == {"mine": [1, 2], "odd": [1]}


def test_distributed_environment():
    assert distributed.from_env({}) is None
    assert distributed.from_env({}, requested=True) == distributed.Cluster()
    assert distributed.from_env({"GRPO_DISTRIBUTED": "auto", "GRPO_INIT_TIMEOUT_S": "30"}) == distributed.Cluster(
        init_timeout_s=30
    )
    c = distributed.from_env({"GRPO_COORDINATOR": "10.0.0.2:8476", "GRPO_NUM_PROCESSES": "4", "GRPO_PROCESS_ID": "3"})
    assert (c.coordinator, c.num_processes, c.process_id) == ("10.0.0.2:8476", 4, 3)
    for env, msg in [
        ({"GRPO_COORDINATOR": "h:1"}, "GRPO_NUM_PROCESSES and GRPO_PROCESS_ID must be too"),
        ({"GRPO_COORDINATOR": "h"}, "must be host:port"),
        ({"GRPO_COORDINATOR": "h:1", "GRPO_NUM_PROCESSES": "2", "GRPO_PROCESS_ID": "2"}, "must be < GRPO_NUM"),
        ({"GRPO_COORDINATOR": "h:1", "GRPO_NUM_PROCESSES": "two", "GRPO_PROCESS_ID": "0"}, "must be an integer"),
        ({"GRPO_DISTRIBUTED": "yes"}, "must be 'auto'"),
    ]:
        with pytest.raises(distributed.DistributedError, match=msg):
            distributed.from_env(env)


def test_launch_plans():
    args = ["grpo_core.stages.worker", "train", "--root", "gs://b/runs/r1", "--until-step", "10"]
    [local], stop = plan(LauncherConfig(), args, python="/py")
    assert local.argv == ["/py", "-m", *args] and local.env == {"GRPO_STOP_WHEN_PARENT_EXITS": "1"} and stop is None

    procs, _ = plan(
        LauncherConfig(kind="multiprocess", num_processes=3, devices_per_process=2, coordinator_port=7000),
        args,
        env={"XLA_FLAGS": "--xla_foo --xla_force_host_platform_device_count=8"},
        python="/py",
    )
    assert [p.env["GRPO_PROCESS_ID"] for p in procs] == ["0", "1", "2"]
    assert {p.env["GRPO_COORDINATOR"] for p in procs} == {"127.0.0.1:7000"}
    assert procs[0].env["XLA_FLAGS"] == "--xla_foo --xla_force_host_platform_device_count=2"
    assert procs[0].env["JAX_PLATFORMS"] == "cpu" and procs[0].env["GRPO_NUM_PROCESSES"] == "3"

    [driver], _ = plan(
        LauncherConfig(kind="ray", address="ray://head:10001", num_processes=4, resources_per_host={"TPU": 4}),
        args,
        env={"A": "1"},
        python="/py",
    )
    assert driver.argv == [
        "/py",
        "-m",
        "grpo_core.launch.launchers",
        "ray",
        "--address",
        "ray://head:10001",
        "--hosts",
        "4",
        "--port",
        "8476",
        "--strategy",
        "STRICT_SPREAD",
        "--resources",
        '{"TPU": 4}',
        "--env",
        '{"A": "1", "GRPO_HEARTBEAT_TIMEOUT_S": "100", "GRPO_INIT_TIMEOUT_S": "300"}',
        "--",
        *args,
    ]

    cfg = LauncherConfig(kind="tpu-vm", tpu_name="pod-v4-16", zone="us-central2-b", project="proj")
    [ssh], stop = plan(cfg, args, env={"GRPO_FAULT": "a b"}, token="t0k")
    head = [
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "ssh",
        "pod-v4-16",
        "--zone=us-central2-b",
        "--project=proj",
        "--worker=all",
    ]
    assert ssh.argv == [
        *head,
        "--command=cd ~/grpo-pipeline && echo $$ > /tmp/grpo-worker-t0k.pid && exec env "
        "GRPO_DISTRIBUTED=auto GRPO_FAULT='a b' GRPO_HEARTBEAT_TIMEOUT_S=100 GRPO_INIT_TIMEOUT_S=300 "
        ".venv/bin/python -m grpo_core.stages.worker train --root gs://b/runs/r1 --until-step 10",
    ]
    assert stop == [
        *head,
        "--command=kill -TERM $(cat /tmp/grpo-worker-t0k.pid 2>/dev/null) 2>/dev/null; "
        "rm -f /tmp/grpo-worker-t0k.pid; true",
    ]
    remote = ssh.argv[-1].split("=", 1)[1]
    assert shlex.split(remote.split("exec ", 1)[1])[:2] == ["env", "GRPO_DISTRIBUTED=auto"]  # valid shell


@pytest.mark.slow
def test_readiness_runs_on_every_process_and_compares_what_each_reads(tmp_path):
    from grpo_core.config.run import RunConfig
    from tasks.readiness import readiness_report

    launcher = {"kind": "multiprocess", "num_processes": 2, "init_timeout_s": 60}
    root = make_run(str(tmp_path), "ready", pipeline={"checkpoint_every": 2, "launcher": launcher})
    cfg = RunConfig.from_dict(RunRoot(root).read_json("config.json"))
    report = readiness_report(cfg)
    assert report["ready"], report["checks"]
    assert (report["process_count"], report["device_count"]) == (2, 2)
    [agree] = [c for c in report["checks"] if c["name"] == "config_agreement"]
    assert agree["detail"] == f"2 processes agree on config {cfg.train_hash} and the first batch"


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the task's preexec_fn; no JAX in a Ray task's process
def test_ray_host_task_runs_the_worker_and_relays_process_0():
    from grpo_core.launch.launchers import _host_task

    class Lines(list):
        put = list.append

    lines = Lines()
    code, tail = _host_task(0, 2, "127.0.0.1:1", ["tests.sleepy_worker", "exit=2"], {}, lines)
    assert code == 2 and json.loads(lines[0])["message"] == "bad field x" and tail == ""
