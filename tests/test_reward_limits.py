"""Reward functions that hang or cannot load: a time limit per call (train.reward_timeout_s) that
stops the worker with the reward exit code, naming the function and the batch, with no retry;
and rewards resolved at the init stage, so a bad reward file fails in the first seconds."""

import os
import re
import time

import pytest

from grpo_core.config.run import RunConfig
from grpo_core.data.prepare import prepare_dataset
from grpo_core.data.tokenizer import make_tokenizer
from grpo_core.errors import ConfigError, ExitCode, RewardTimeout, classify, is_retryable
from grpo_core.rewards.functions import Reward, RewardFunctionError, score
from grpo_core.rewards.registry import config_rewards
from grpo_core.store.runs import init_run_root

SLOW = """\
import time


def slow(prompts, completions, **columns):
    time.sleep(1000)  # a reward that never returns (a stuck request, an endless loop)
    return [0.0] * len(completions)
"""


def test_a_call_past_its_time_limit_names_the_function_and_the_batch():
    def slow(prompts, completions, **_):
        time.sleep(1000)

    reward = Reward(slow, name="slow", field="rewards[0].function", spec="my_rewards.py:slow")
    t = time.monotonic()
    with pytest.raises(RewardTimeout) as err:
        score([reward], ["p"] * 4, ["c"] * 4, {"answer": ["a"] * 4}, timeout_s=0.5, batch="the batch of step 7")
    assert time.monotonic() - t < 5
    msg = str(err.value)
    for part in (
        "'slow' (rewards[0].function: my_rewards.py:slow)",
        "within 0.5 s",
        "the batch of step 7",
        "(4 completions)",
        "train.reward_timeout_s",
        "not retried",
    ):
        assert part in msg, (part, msg)
    failure = classify(err.value)
    assert failure.code == ExitCode.REWARD and not failure.retryable and not is_retryable(failure.code)


def test_bounded_calls_return_values_and_errors_as_before():
    def half(prompts, completions, answer, **_):
        return [None if a is None else 0.5 for a in answer]

    def boom(prompts, completions, **_):
        return [1 / (c != "bad") for c in completions]

    out = score([Reward(half)], ["p", "q"], ["x", "y"], {"answer": ["a", None]}, timeout_s=5)
    assert out.total[0] == 0.5 and out.total[1] != out.total[1] and out.frac_scored == 0.5
    with pytest.raises(RewardFunctionError, match=r"'boom' raised ZeroDivisionError: division by zero on row 1"):
        score([Reward(boom)], ["p", "q"], ["ok", "bad"], timeout_s=5)


def test_the_time_limit_is_a_config_field_outside_the_training_hash():
    cfg = RunConfig.from_dict({})
    assert cfg.train.reward_timeout_s == 300.0
    longer = RunConfig.from_dict({"train": {"reward_timeout_s": 900}})
    assert longer.train.reward_timeout_s == 900.0 and longer.train_hash == cfg.train_hash  # changes no result
    with pytest.raises(ConfigError, match=r"train.reward_timeout_s must be > 0, got 0.0"):
        RunConfig.from_dict({"train": {"reward_timeout_s": 0}})


def test_a_reward_that_needs_the_main_thread_is_told_how_to_fix_it():
    """TRL / open-r1 accuracy rewards call math-verify with its default time limits, which use
    signal.alarm and so only work in the main thread; under a reward time limit they run in a
    thread of their own, and the error must say what to change."""
    pytest.importorskip("math_verify")

    def accuracy(prompts, completions, **_):
        import math_verify

        return [float(math_verify.verify(math_verify.parse("$1/2$"), math_verify.parse(c))) for c in completions]

    assert score([Reward(accuracy)], ["p"], ["$0.5$"]).total[0] == 1.0  # unbounded: in this (main) thread
    with pytest.raises(RewardFunctionError, match=r"'accuracy' raised ValueError.*parsing_timeout=None") as err:
        score([Reward(accuracy)], ["p"], ["$0.5$"], timeout_s=30)
    assert "train.reward_timeout_s" in str(err.value)


# -- rewards resolved at init ---------------------------------------------------------------

BAD_REWARDS = {
    "missing file": ("{d}/nope.py:score", r"rewards\[0\].function: reward file '.*nope.py' .* does not exist"),
    "missing function": ("{d}/r.py:missing", r"rewards\[0\].function: .* has no function 'missing'; it defines ok"),
    "wrong signature": ("{d}/r.py:one_arg", r"rewards\[0\].function: .* must accept \(prompts, completions"),
    "import error": ("{d}/broken.py:ok", r"rewards\[0\].function: reward file .* fails to import: NameError"),
}


def _reward_files(d):
    (d / "r.py").write_text(
        "def ok(prompts, completions, **kw):\n    return [1.0] * len(completions)\n\n\n"
        "def one_arg(completions):\n    return [1.0] * len(completions)\n"
    )
    (d / "broken.py").write_text("x = undefined_name\n\n\ndef ok(prompts, completions, **kw):\n    return []\n")


@pytest.mark.parametrize("case", sorted(BAD_REWARDS))
def test_config_rewards_resolves_every_reward(tmp_path, case):
    _reward_files(tmp_path)
    spec, message = BAD_REWARDS[case]
    cfg = RunConfig.from_dict({"rewards": [{"function": spec.format(d=tmp_path)}]})
    with pytest.raises(ConfigError, match=message):
        config_rewards(cfg)
    evals = RunConfig.from_dict(
        {"eval": {"rewards": [{"function": "exact_match"}, {"function": spec.format(d=tmp_path)}]}}
    )
    with pytest.raises(ConfigError, match=message.replace(r"rewards\[0\]", r"eval.rewards\[1\]")):
        config_rewards(evals)
    if case in ("missing file", "import error"):  # workers on other hosts may have what this one lacks
        config_rewards(cfg, skip_missing=True)


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
@pytest.mark.parametrize("case", sorted(BAD_REWARDS))
def test_a_bad_reward_fails_the_run_at_init(tmp_path, case):
    from tests.test_pipeline import failed_run, small_config, task_runs

    _reward_files(tmp_path)
    spec, message = BAD_REWARDS[case]
    t = time.monotonic()
    state, msg = failed_run(small_config(str(tmp_path), "bad", rewards=[{"function": spec.format(d=tmp_path)}]))
    took = time.monotonic() - t
    assert took < 15, took  # not after data preparation and readiness, 35-44 s in
    assert re.search(message, msg), msg
    assert task_runs(state) == {"init-run": 1}  # a config error: not retried, nothing after it
    assert not (tmp_path / "bad" / "config.json").exists()


# -- a hung reward in the real worker ------------------------------------------------------


def make_run(root: str, name: str, reward: str) -> str:
    """A run folder as the pipeline leaves it before training (config.json and prepared data),
    whose only reward is `reward`, with a 2 s reward time limit."""
    cfg = RunConfig.from_dict(
        {
            "run_name": name,
            "storage": {"root": root},
            "data": {"eval_rows": 8, "synthetic_rows": 64},
            "rewards": [{"function": reward}],
            "train": {"num_steps": 2, "grpo": {"prompts_per_step": 4}, "reward_timeout_s": 2},
            "eval": {"num_samples": 1, "batch_size": 8},
        }
    )
    run = init_run_root(cfg)
    prepare_dataset(cfg.data, make_tokenizer(cfg), run, cfg.tokenizer_id)
    return cfg.run_url


@pytest.mark.slow
def test_the_worker_stops_a_hung_reward_with_the_reward_exit_code_and_no_retry(tmp_path):
    from tasks.process import StageError, run_worker
    from tasks.stages import can_retry

    (tmp_path / "slow_rewards.py").write_text(SLOW)
    spec = f"{tmp_path}/slow_rewards.py:slow"
    root = make_run(str(tmp_path), "hung", spec)
    for args, batch in (
        (["train", "--until-step", "2"], "on the batch of step 0 (32 completions)"),
        (["eval", "--steps", "0"], "on the evaluation batch of rows 0..7 (greedy) (8 completions)"),
    ):
        seen = []
        t = time.monotonic()
        with pytest.raises(StageError) as err:
            run_worker(
                ["grpo_core.stages.worker", *args, "--root", root], timeout_s=300, on_event=seen.append, what="w"
            )
        took = time.monotonic() - t
        msg = str(err.value)
        assert "w failed (reward function error)" in msg, msg  # exit code 3, ExitCode.REWARD
        assert f"'slow' (rewards[0].function: {spec}) did not return within 2 s {batch}" in msg, msg
        assert "train.reward_timeout_s" in msg
        assert not err.value.retryable and not can_retry(err.value)  # the task's retry condition
        assert [e["kind"] for e in seen if e["event"] == "error"] == ["reward"]
        assert took < 120, took  # JAX start-up and compilation, then 2 s: not the stage's 3600 s limit
    assert not os.path.exists(f"{root}/checkpoints/2")


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_a_run_whose_reward_hangs_in_training_fails_at_once(tmp_path):
    """Through the pipeline: the reward answers the data stage's probe (completions equal to the
    answers) and hangs on the model's completions; the epoch fails once, not retried."""
    from tests.test_pipeline import failed_run, small_config, task_runs

    (tmp_path / "hangs.py").write_text(
        "import time\n\n\n"
        "def hangs(prompts, completions, answer, **kw):\n"
        "    if list(completions) != list(answer):\n"
        "        time.sleep(1000)\n"
        "    return [1.0] * len(completions)\n"
    )
    cfg = small_config(
        str(tmp_path), "hangs", rewards=[{"function": f"{tmp_path}/hangs.py:hangs"}], train={"reward_timeout_s": 2}
    )
    state, msg = failed_run(cfg)
    assert "reward function error" in msg and "'hangs' (rewards[0].function:" in msg, msg
    assert "did not return within 2 s on the batch of step 0 (32 completions)" in msg, msg
    runs = task_runs(state)
    assert runs["prepare-dataset"] == 1 and runs["train-epoch-0"] == 1  # not retried
