"""A reward that gives every completion of every group the same score "trained" silently (issue 28,
item 5: frac_reward_zero_std 1.0 on every step, exit 0): now a warning every
pipeline.zero_signal_steps steps in a row, and a reward error at pipeline.zero_signal_fail_steps."""

import json
import subprocess
import sys

import pytest

from grpo_core.config.run import RunConfig
from grpo_core.errors import ExitCode, RewardFunctionError
from grpo_core.stages import worker

CONST = "def const(prompts, completions, **kw):\n    return [0.5] * len(completions)\n"


def test_warn_then_fail(capsys):
    pipeline = RunConfig.from_dict({"pipeline": {"zero_signal_steps": 2, "zero_signal_fail_steps": 5}}).pipeline
    for flat in (0, 1, 3):
        worker.no_signal(flat, 10, pipeline, ["'const'"])
    assert capsys.readouterr().out == ""
    worker.no_signal(4, 10, pipeline, ["'const'"])
    [event] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert event["event"] == "no_signal" and event["steps"] == 4
    assert (
        "for 4 steps in a row (to step 10) every group's completions got the same reward from 'const'"
        in (event["message"])
    )
    assert event["message"].endswith("the run fails at 5")
    with pytest.raises(RewardFunctionError, match="stopped by pipeline.zero_signal_fail_steps=5"):
        worker.no_signal(5, 11, pipeline, ["'const'"])
    default = RunConfig.from_dict({}).pipeline
    assert (default.zero_signal_steps, default.zero_signal_fail_steps) == (20, 0)  # warn only, by default


@pytest.mark.slow
def test_a_constant_reward_fails_the_worker_as_a_reward_error(tmp_path):
    from tests.test_worker import make_run

    (tmp_path / "const.py").write_text(CONST)
    run = make_run(
        str(tmp_path),
        "r",
        rewards=[{"function": f"{tmp_path}/const.py:const"}],
        eval={"rewards": [{"function": "exact_match"}], "accuracy_reward": "exact_match", "num_samples": 2},
        pipeline={"checkpoint_every": 2, "zero_signal_steps": 1, "zero_signal_fail_steps": 3},
    )
    out = subprocess.run(
        [sys.executable, "-m", "grpo_core.stages.worker", "train", "--until-step", "6", "--root", run],
        capture_output=True,
        text=True,
        timeout=300,
    )
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == ExitCode.REWARD, out.stderr[-2000:]
    assert [e["steps"] for e in events if e["event"] == "no_signal"] == [1, 2]
    [error] = [e for e in events if e["event"] == "error"]
    assert error["kind"] == "reward" and "stopped by pipeline.zero_signal_fail_steps=3" in error["message"]
    assert "const.py:const" in error["message"]
