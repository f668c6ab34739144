"""Agentic GRPO with the real model: the tiny preset learns to call the synthetic tool task's tool
(grpo demo --task tools, without the pipeline and shorter), and a worker killed in the middle of
an episode (a tool call SIGKILLs it) resumes to the same bytes as a run that was never killed."""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from grpo_core.config.run import DEMO_TASKS, RunConfig
from grpo_core.data.prepare import prepare_dataset
from grpo_core.data.tokenizer import make_tokenizer
from grpo_core.rl.checkpoint import Checkpointer
from grpo_core.store.root import RunRoot
from grpo_core.store.runs import init_run_root
from tests.cpu_devices import run_with_devices

pytestmark = pytest.mark.slow


def test_the_tiny_model_learns_to_call_its_tool():
    # 120 steps compute more than they compile: with XLA's optimised code, so in a child process (as
    # tests/test_trainer.py's learning run; 45 against 58 CPU-s with the tests' FAST_COMPILE)
    run_with_devices(1, "import tests.test_agent_run as t; t.learn_to_call()", timeout_s=1200, optimized=True)


def learn_to_call():
    """The demo's tool task without the pipeline: at step 0 almost no episode calls the tool;
    within 120 steps nearly every one does, and its answer turn follows the result (two turns an
    episode)."""
    from grpo_core.config.presets import get_preset
    from grpo_core.data.synthetic import CharTokenizer, ReverseTask
    from grpo_core.nn.model import create_model
    from grpo_core.rewards.registry import config_rewards
    from grpo_core.rl.trainer import GRPOTrainer

    cfg = RunConfig.from_dict({**DEMO_TASKS["tools"], "train": {**DEMO_TASKS["tools"]["train"], "num_steps": 120}})
    tok = CharTokenizer()
    model = create_model(get_preset("tiny", vocab_size=tok.vocab_size), cfg.model.seed)
    rewards, _ = config_rewards(cfg)
    trainer = GRPOTrainer(model, cfg.train, tok, rewards, ReverseTask.of(cfg.data.task()))
    try:
        history = trainer.train()
    finally:
        trainer.close()
    calls = [m["tool_calls_per_episode"] for m in history]
    assert np.mean(calls[:5]) < 0.3, calls[:5]
    assert np.mean(calls[-10:]) >= 0.9, calls[-10:]
    assert np.mean([m["turns_per_episode"] for m in history[-10:]]) > 1.8
    assert all(m["tool_errors_per_episode"] <= m["tool_calls_per_episode"] for m in history)
    assert "time/tools" in history[-1] and "tools/code/calls" in history[-1]


VAULT = '''
import os, signal

CALLS = [0]


class Vault:
    """The codebook task's vault, as a user's file: its tool SIGKILLs the worker at its Nth call in a
    process, once (a flag file), in the middle of an episode."""

    def reset(self, answer: str = "", **row) -> None:
        self._code = answer

    def code(self) -> str:
        """Read the code locked in the vault for this episode."""
        CALLS[0] += 1
        flag = os.environ.get("VAULT_KILL_FLAG")
        if flag and CALLS[0] == int(os.environ["VAULT_KILL_AT"]) and not os.path.exists(flag):
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return self._code
'''


def _make_run(root: str, name: str, vault: str) -> str:
    tools = DEMO_TASKS["tools"]
    cfg = RunConfig.from_dict(
        {
            **tools,
            "run_name": name,
            "storage": {"root": root},
            "data": {**tools["data"], "eval_rows": 8, "synthetic_rows": 64},
            "train": {
                **tools["train"],
                "num_steps": 6,
                "grpo": {"prompts_per_step": 8},
                "optimizer": {"learning_rate": 1e-2},
                "agent": {**tools["train"]["agent"], "environment": f"{vault}:Vault"},
            },
            "pipeline": {"checkpoint_every": 2},
        }
    )
    run = init_run_root(cfg)
    prepare_dataset(cfg.data, make_tokenizer(cfg), run, cfg.tokenizer_id)
    return cfg.run_url


def _train(root: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "grpo_core.stages.worker", "train", "--until-step", "6", "--root", root],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def test_a_worker_killed_mid_episode_resumes_to_the_same_bytes(tmp_path):
    vault = tmp_path / "vault.py"
    vault.write_text(VAULT)
    straight = _make_run(str(tmp_path), "straight", str(vault))
    assert _train(straight).returncode == 0
    calls = sum(float(r["tool_calls_per_episode"]) * 64 for r in RunRoot(straight).read_metrics())
    assert calls >= 8, calls  # the random policy calls the tool now and then: the kill below has calls to hit

    killed = _make_run(str(tmp_path), "killed", str(vault))
    flag = tmp_path / "killed-once"
    env = {"VAULT_KILL_FLAG": str(flag), "VAULT_KILL_AT": str(int(calls * 0.6))}  # past the first checkpoint
    first = _train(killed, env)
    assert first.returncode == -signal.SIGKILL and flag.exists(), first.stderr[-2000:]
    events = [json.loads(line) for line in first.stdout.splitlines() if line.startswith("{")]
    died_after = max(e["step"] for e in events if e["event"] == "step")
    assert 2 <= died_after < 6  # in a step after a checkpoint: that step's episodes are drawn again
    again = _train(killed, env)
    assert again.returncode == 0, again.stderr[-2000:]
    resumed = [json.loads(line) for line in again.stdout.splitlines() if line.startswith("{")]
    assert resumed[1]["event"] == "resumed" and resumed[1]["step"] in (2, 4)

    a, b = RunRoot(straight).read_metrics(), RunRoot(killed).read_metrics()
    assert [r["step"] for r in b] == list(range(6))
    keys = ("reward", "loss", "tool_calls_per_episode", "turns_per_episode", "completions/mean_length")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    with (
        Checkpointer(RunRoot(straight).uri("checkpoints")) as c1,
        Checkpointer(RunRoot(killed).uri("checkpoints")) as c2,
    ):
        (s1, _), (s2, _) = c1.restore(6), c2.restore(6)

    jax.tree.map(np.testing.assert_array_equal, s1["params"], s2["params"])  # the same bytes
