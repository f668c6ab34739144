"""Empty values in the data: a row whose prompt or reference answer is empty (a blank CSV cell,
null, whitespace) is dropped and counted by column in the manifest, never trained on as "" and
never counted as too long; a file with nothing but empty prompts fails naming the column."""

import csv

import pytest

from grpo_core.data.prepare import DataConfig, DataError, load_prepared, prepare_dataset
from grpo_core.data.synthetic import CharTokenizer
from grpo_core.store.root import RunRoot

TOK = CharTokenizer()


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["question", "answer"])
        w.writerows(rows)
    return str(path)


def prep(tmp_path, source, **fields):
    root = RunRoot(str(tmp_path / "run"))
    return root, prepare_dataset(
        DataConfig(source=source, format="plain", prompt_column="question", **fields), TOK, root, "char"
    )


def test_empty_prompts_and_answers_are_counted_by_column(tmp_path):
    rows = [[f"{i}+1", str(i + 1)] for i in range(10)] + [["", "7"], ["   ", "8"], ["2+2", ""], ["3+3", " "]]
    root, m = prep(tmp_path, write_csv(tmp_path / "q.csv", rows), eval_fraction=0.2)
    assert m["dropped_empty"] == {"question": 2, "answer": 2}
    assert m["dropped_too_long"] == 0
    assert m["train_rows"] + m["eval_rows"] == 10
    train, evals = load_prepared(root, m["hash"])
    assert all(str(r["answer"]).strip() for r in train + evals)  # no row trained on with an empty answer
    assert {r["prompt"] for r in train + evals}.isdisjoint({"2+2", "3+3", "", "   "})


def test_a_row_empty_in_both_counts_under_each(tmp_path):
    rows = [[f"{i}+1", str(i + 1)] for i in range(6)] + [["", ""]]
    _, m = prep(tmp_path, write_csv(tmp_path / "q.csv", rows))
    assert m["dropped_empty"] == {"question": 1, "answer": 1} and m["train_rows"] + m["eval_rows"] == 6


def test_only_empty_prompts_fails_naming_the_column(tmp_path):
    source = write_csv(tmp_path / "q.csv", [["", "1"], ["", "2"], ["", "3"]])
    with pytest.raises(DataError, match=r"q.csv: every one of 3 rows has an empty value \(question: 3\)"):
        prep(tmp_path, source)
    assert not RunRoot(str(tmp_path / "run")).list("data") or not any(
        RunRoot(str(tmp_path / "run")).is_done(f"data/{h}") for h in RunRoot(str(tmp_path / "run")).list("data")
    )


def test_jsonl_nulls_count_as_empty(tmp_path):
    lines = [f'{{"question": "{i}+1", "answer": "{i + 1}"}}' for i in range(6)] + ['{"question": null, "answer": "3"}']
    (tmp_path / "q.jsonl").write_text("\n".join(lines) + "\n")
    _, m = prep(tmp_path, str(tmp_path / "q.jsonl"))
    assert m["dropped_empty"] == {"question": 1}
