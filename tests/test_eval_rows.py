"""Evaluating on a benchmark's rows: a separate eval file (data.eval_source), the whole split
(data.eval_rows: all), a seeded sample (not the first rows) when eval_rows caps a longer split,
and the error for eval_split on a one-file source that names the forms that work."""

import json

import pytest

from grpo_core.data.prepare import DataConfig, load_prepared, prepare_dataset
from grpo_core.data.synthetic import CharTokenizer
from grpo_core.errors import ConfigError
from grpo_core.store.root import RunRoot

TOK = CharTokenizer()


def write_jsonl(path, n, start=0):
    path.write_text(
        "".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(start, start + n))
    )
    return str(path)


def prep(tmp_path, **fields):
    root = RunRoot(str(tmp_path / "run"))
    m = prepare_dataset(DataConfig(format="plain", prompt_column="question", **fields), TOK, root, "char")
    return m, *load_prepared(root, m["hash"])


def test_a_separate_eval_file_whole(tmp_path):
    train_file = write_jsonl(tmp_path / "train.jsonl", 50)
    test_file = write_jsonl(tmp_path / "test.jsonl", 300, start=1000)
    m, train, evals = prep(tmp_path, source=train_file, eval_source=test_file, eval_rows="all")
    assert (m["train_rows"], m["eval_rows"]) == (50, 300)  # no training row held out, every test row kept
    assert {r["prompt"] for r in evals} == {f"{i}+1" for i in range(1000, 1300)}
    assert m["eval_source"] == test_file


def test_a_capped_eval_split_is_a_seeded_sample_not_its_first_rows(tmp_path):
    train_file = write_jsonl(tmp_path / "train.jsonl", 20)
    test_file = write_jsonl(tmp_path / "test.jsonl", 300, start=1000)
    _, _, evals = prep(tmp_path, source=train_file, eval_source=test_file, eval_rows=50)
    picked = [int(r["prompt"].split("+")[0]) for r in evals]
    assert len(picked) == 50 and picked == sorted(picked) and max(picked) > 1100  # spread over the file, in order
    _, _, again = prep(tmp_path / "b", source=train_file, eval_source=test_file, eval_rows=50)
    assert [r["prompt"] for r in again] == [r["prompt"] for r in evals]  # the same sample every time


def test_config_errors_lead_to_the_forms_that_work(tmp_path):
    with pytest.raises(ConfigError, match=r"data.eval_source=path/to/test.jsonl, or make data.source a folder"):
        DataConfig(source="train.jsonl", eval_split="test")
    with pytest.raises(ConfigError, match=r"data.eval_rows=all takes every row of data.eval_split or data.eval_source"):
        DataConfig(source="train.jsonl", eval_rows="all")
    with pytest.raises(ConfigError, match=r"not both"):
        DataConfig(source="openai/gsm8k", eval_split="test", eval_source="test.jsonl")
