"""A run that can learn nothing must not report success: a reward that scores none of the data
fails the data stage (naming the reward, the data and the likely cause), a step with no scored
row says so in its metrics and the log, and every JSON object in the run root is strict JSON
(NaN and Infinity are not JSON: they are written as null)."""

import json
import logging
import math

import pytest

from grpo_core.config.run import RunConfig
from grpo_core.data.prepare import prepare_dataset
from grpo_core.data.tokenizer import make_tokenizer
from grpo_core.errors import ConfigError, DataError
from grpo_core.rewards.probe import check_prepared
from grpo_core.store.report import build_summary, eval_results
from grpo_core.store.root import RunRoot
from grpo_core.store.runs import init_run_root


def strict_loads(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as JSON itself (RFC 8259) does."""

    def refuse(word):
        raise ValueError(f"not JSON: {word}")

    return json.loads(text, parse_constant=refuse)


def gsm8k_file(path, n=40):
    path.write_text(
        "".join(
            json.dumps({"question": f"what is {i} + {i}?", "answer": f"{i} + {i} = {2 * i} #### {2 * i}"}) + "\n"
            for i in range(n)
        )
    )
    return str(path)


def prepared(tmp_path, data: dict, rewards: list, **extra) -> tuple[RunConfig, RunRoot]:
    """A run as the data stage leaves it: config.json and the prepared rows."""
    cfg = RunConfig.from_dict(
        {
            "run_name": "r",
            "storage": {"root": str(tmp_path / "runs")},
            "data": {"max_prompt_tokens": 64, **data},
            "rewards": rewards,
            **extra,
        }
    )
    root = init_run_root(cfg)
    prepare_dataset(cfg.data, make_tokenizer(cfg), root, cfg.tokenizer_id)
    return cfg, root


def test_math_answer_on_data_without_ground_truth_fails_the_data_stage(tmp_path):
    source = gsm8k_file(tmp_path / "gsm.jsonl")
    math = [{"function": "math_answer"}, {"function": "think_format", "weight": 0.2}]
    cfg, root = prepared(tmp_path, {"source": source, "format": "plain", "prompt_column": "question"}, math)
    with pytest.raises(DataError) as err:
        check_prepared(cfg, root)
    msg = str(err.value)
    for part in (
        "rewards[0].function 'math_answer' scored none of 32 sampled training rows",
        f"data.source '{source}' (read as plain)",
        "returned None for every row, even with the row's own reference answer as the completion",
        "the run would learn nothing",
        "no 'ground_truth' column (columns: answer)",  # what the reward is passed: the question is the prompt
        "data.format=gsm8k or verl",
    ):
        assert part in msg, (part, msg)

    # The same file read as what it is: every probe row scores.
    cfg, root = prepared(tmp_path / "auto", {"source": source, "prompt_column": "question"}, math)
    found = {c.reward.name: c for c in check_prepared(cfg, root) if c.split == "training"}
    assert found["math_answer"].scored == 32 and found["think_format"].scored == 32


def test_a_renamed_answer_column_is_named_as_the_likely_cause(tmp_path):
    source = gsm8k_file(tmp_path / "gsm.jsonl")
    data = {"source": source, "prompt_column": "question", "rename": {"answer": "target"}}
    cfg, root = prepared(tmp_path, data, [{"function": "math_answer"}])
    with pytest.raises(DataError, match=r"read as plain\).*data.format=auto found no gsm8k.*data.rename"):
        check_prepared(cfg, root)


def test_the_eval_accuracy_reward_must_score_the_eval_rows(tmp_path):
    source = gsm8k_file(tmp_path / "gsm.jsonl")
    data = {"source": source, "prompt_column": "question"}
    rewards = [{"function": "math_answer"}]
    evals = {
        "eval": {
            "rewards": [{"function": "math_answer"}, {"function": f"{tmp_path}/r.py:never"}],
            "accuracy_reward": "never",
        }
    }
    (tmp_path / "r.py").write_text("def never(prompts, completions, **kw):\n    return [None] * len(completions)\n")
    cfg, root = prepared(tmp_path, data, rewards, **evals)
    with pytest.raises(DataError, match=r"eval.rewards\[1\].function '.*r.py:never' scored none of 4 sampled evaluati"):
        check_prepared(cfg, root)


def test_signatures_are_checked_against_the_columns(tmp_path):
    (tmp_path / "r.py").write_text(
        "def needs(prompts, completions, solution, **kw):\n    return [0.0] * len(completions)\n\n\n"
        "def strict(prompts, completions, answer):\n    return [0.0] * len(completions)\n"
    )
    data = {"source": gsm8k_file(tmp_path / "gsm.jsonl"), "prompt_column": "question"}
    cfg, root = prepared(tmp_path, data, [{"function": f"{tmp_path}/r.py:needs"}])
    with pytest.raises(ConfigError, match=r"rewards\[0\].function .* reads column\(s\) 'solution', which the prepared"):
        check_prepared(cfg, root)
    cfg, root = prepared(tmp_path / "b", data, [{"function": f"{tmp_path}/r.py:strict"}])
    with pytest.raises(ConfigError, match=r"takes no keyword for column\(s\) 'ground_truth'.*add \*\*kwargs"):
        check_prepared(cfg, root)


def test_a_reward_that_rejects_the_probe_is_left_to_training(tmp_path):
    """No false alarm: a function that raises on made-up completions may still score the model's;
    its real errors are reported, with the row, by the first training step."""
    (tmp_path / "r.py").write_text("def picky(prompts, completions, **kw):\n    raise ValueError('not mine')\n")
    cfg, root = prepared(
        tmp_path, {"source": "synthetic", "synthetic_rows": 64}, [{"function": f"{tmp_path}/r.py:picky"}]
    )
    [train, evals] = check_prepared(cfg, root)
    assert train.scored == 0 and len(train.failed) == 4 and "not judged" in train.describe()


def test_summary_of_a_run_with_nan_values_is_strict_json(tmp_path):
    root = RunRoot(str(tmp_path / "run"))
    nan, inf = float("nan"), float("inf")
    root.write_metrics(
        [
            {"step": 0, "reward": nan, "frac_rows_scored": 0.0, "loss": 0.0},
            {"step": 1, "reward": 0.5, "frac_rows_scored": 1.0, "loss": inf},
        ]
    )
    root.write_json("eval/0.json", {"step": 0, "accuracy": nan, "greedy": {"reward_mean": nan, "num_rows": 8.0}})
    root.write_json("eval/2.json", {"step": 2, "accuracy": 0.25, "greedy": {"reward_mean": 0.5, "num_rows": 8.0}})
    summary = build_summary(root, "completed")
    root.write_json("summary.json", summary)

    written = strict_loads(root.read_bytes("summary.json").decode())
    assert written["eval_before"] == {"step": 0, "accuracy": None, "reward_mean": None}
    assert written["eval_after"]["accuracy"] == 0.25
    assert written["reward_mean_first"] is None and written["reward_mean_last"] == 0.5  # step 0 scored nothing
    for name in root.list("metrics"):
        for line in root.read_bytes(f"metrics/{name}").decode().splitlines():
            strict_loads(line)
    strict_loads(root.read_bytes("eval/0.json").decode())
    # Read back as the floats every reader formats: null is NaN again.
    assert math.isnan(root.read_metrics()[0]["reward"]) and math.isinf(root.read_metrics()[1]["loss"]) is False
    assert math.isnan(eval_results(root)[0]["accuracy"]) and math.isnan(eval_results(root)[0]["greedy"]["reward_mean"])


@pytest.mark.slow
def test_a_step_no_reward_scores_says_so(caplog):
    from grpo_core.rewards.functions import Reward
    from tests.test_trainer import make

    def never(prompts, completions, **_):
        return [None] * len(completions)

    tr, _ = make(steps=2, rewards=[Reward(never)])
    with caplog.at_level(logging.WARNING, logger="grpo_core.rl.trainer"):
        m = tr.train_step()
    assert m["frac_rows_scored"] == 0.0 and math.isnan(m["reward"]) and m["loss"] == 0.0
    assert f"step 0: no reward scored any of its {tr.cfg.grpo.batch_size} completions" in caplog.text
    tr, _ = make(steps=2)
    assert tr.train_step()["frac_rows_scored"] == 1.0


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_a_run_that_would_learn_nothing_fails_at_the_data_stage(tmp_path):
    from tests.test_pipeline import failed_run, small_config, task_runs

    source = gsm8k_file(tmp_path / "gsm.jsonl")
    cfg = small_config(
        str(tmp_path),
        "plain",
        data={"source": source, "format": "plain", "prompt_column": "question", "max_prompt_tokens": 64},
        rewards=[{"function": "math_answer"}],
    )
    state, msg = failed_run(cfg)
    assert "rewards[0].function 'math_answer' scored none of 32 sampled training rows" in msg, msg
    runs = task_runs(state)
    assert runs["prepare-dataset"] == 1 and "check-readiness" not in runs  # a data error: not retried
    summary = strict_loads((tmp_path / "plain" / "summary.json").read_text())
    assert summary["status"] == "failed" and "scored none of" in summary["error"] and summary["steps"] == 0
