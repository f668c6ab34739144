"""The Ray launcher end to end, run by tests/test_ray_launcher.py inside a network namespace of
its own (loopback only), where a local Ray instance cannot bind to any other interface:

    python -m tests.ray_e2e ROOT

Two runs of the same config through run_worker with launcher kind ray (address local: the
driver starts a Ray instance and stops it when it exits; two host tasks on this one node):
one straight to step 6, one whose process 1 is SIGKILLed after step 3, then retried. Prints one
JSON line of what happened; the test checks it.
"""

import json
import os
import sys

import jax
import numpy as np

from grpo_core.launch.launchers import LauncherConfig
from grpo_core.rl.checkpoint import Checkpointer
from grpo_core.store.root import RunRoot
from tasks.process import StageError, run_worker
from tests.faults import HOOK
from tests.test_worker import make_run

RAY = LauncherConfig(
    kind="ray",
    address="local",
    num_processes=2,
    placement_strategy="PACK",  # both host tasks on this one node
    resources_per_host={"CPU": 1},
    init_timeout_s=120,
    heartbeat_timeout_s=30,
)


def train(root: str, **kw):
    return run_worker(
        ["grpo_core.stages.worker", "train", "--root", root, "--until-step", "6"],
        timeout_s=400,
        what="training",
        launcher=RAY,
        **kw,
    )


def params(root: str):
    with Checkpointer(RunRoot(root).uri("checkpoints")) as ckpt:
        state, _ = ckpt.restore(6)
    return state["params"]


def main(base: str) -> dict:
    out: dict = {}
    straight = make_run(base, "straight")
    ev = train(straight, on_event=lambda e: None)
    out["straight"] = [e["event"] for e in ev if e["event"] in ("start", "done")]
    killed = make_run(base, "killed")
    seen: list[dict] = []
    env = {"GRPO_TEST_HOOK": HOOK, "GRPO_FAULT": f"step:3:{base}/fault-fired", "GRPO_FAULT_PROCESS": "1"}
    try:
        train(killed, on_event=seen.append, env=env)
        out["kill"] = "no error"
    except StageError as exc:
        out["kill"] = str(exc).splitlines()[0]
        out["kill_retryable"] = exc.retryable
    out["fault_fired"] = os.path.exists(f"{base}/fault-fired")
    out["checkpoints_before_retry"] = [e["step"] for e in seen if e["event"] == "checkpoint"]
    ev = train(killed, on_event=lambda e: None)
    out["retry"] = [{k: e[k] for k in ("event", "step")} for e in ev if e["event"] in ("resumed", "done")]
    out["metric_steps"] = [r["step"] for r in RunRoot(killed).read_metrics()]
    a, b = params(straight), params(killed)
    out["max_param_diff"] = max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
