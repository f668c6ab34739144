"""The training worker as a real process: JSON-line progress, SIGKILL mid-run, exact resume."""

import copy
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from grpo_core.checkpoint import Checkpointer
from grpo_core.recipes import SYNTHETIC_DEFAULT
from grpo_core.storage import RunRoot

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    cfg = copy.deepcopy(SYNTHETIC_DEFAULT)
    cfg["train"]["num_steps"] = 6
    cfg["train"]["grpo"]["prompts_per_step"] = 4
    cfg["train"]["optimizer"]["learning_rate"] = 1e-2
    path = tmp_path_factory.mktemp("cfg") / "run.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def worker(config, root, until, every=2):
    return subprocess.Popen([sys.executable, "-m", "grpo_core.worker", "--config", config, "--root", root,
                             "--until-step", str(until), "--checkpoint-every", str(every)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def events(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


def final_params(root, step=6):
    with Checkpointer(RunRoot(root).uri("checkpoints")) as ckpt:
        state, meta = ckpt.restore(step)
    assert meta["step"] == step
    return state["params"]


def test_kill_resume_equals_uninterrupted(config_file, tmp_path):
    straight = str(tmp_path / "straight")
    ev = events(worker(config_file, straight, 6))
    assert ev[0] == {"event": "start", "step": 0, "until": 6}
    assert [e["step"] for e in ev if e["event"] == "checkpoint"] == [2, 4, 6]
    assert ev[-1] == {"event": "done", "step": 6, "steps_run": 6}

    killed = str(tmp_path / "killed")
    proc = worker(config_file, killed, 6)
    seen = []
    for line in proc.stdout:  # kill after the checkpoint at 2, in the middle of steps 3..4
        seen.append(json.loads(line))
        if seen[-1]["event"] == "step" and seen[-1]["step"] == 2:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ev = events(worker(config_file, killed, 6))
    assert ev[0] == {"event": "resumed", "step": 2, "until": 6}
    assert ev[-1] == {"event": "done", "step": 6, "steps_run": 4}

    a, b = RunRoot(straight).read_metrics(), RunRoot(killed).read_metrics()
    assert [r["step"] for r in b] == list(range(6))  # none missing, none doubled
    for x, y in zip(a, b):
        assert y["reward"] == pytest.approx(x["reward"], abs=1e-6) and y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-7)
    jax.tree.map(lambda p, q: np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6),
                 final_params(straight), final_params(killed))


def test_epoch_boundary_and_finished_runs(config_file, tmp_path):
    root = str(tmp_path / "epochs")
    assert events(worker(config_file, root, 4))[-1]["steps_run"] == 4
    ev = events(worker(config_file, root, 6))  # resumed exactly at the boundary: trains 4 and 5
    assert ev[0]["event"] == "resumed" and [e["step"] for e in ev if e["event"] == "step"] == [4, 5]
    ev = events(worker(config_file, root, 6))  # finished: no training at all
    assert [e["event"] for e in ev] == ["resumed", "done"] and ev[-1]["steps_run"] == 0


def test_config_error_exit_code(config_file, tmp_path):
    proc = worker(config_file, str(tmp_path / "r"), 99)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert json.loads(out.splitlines()[-1]) == {"event": "error", "kind": "config",
                                                 "message": "--until-step 99 is past train.num_steps (6)"}
