"""Dataset preparation: every source, templates and chat, the length filter, the split, the
marker written last, and bad data that names its file, column or row and marks nothing done."""

import json

import pandas as pd
import pytest

from grpo_core.data.prepare import DataConfig, DataError, DatasetPrompts, data_hash, load_prepared, prepare_dataset
from grpo_core.data.synthetic import CharTokenizer
from grpo_core.errors import ConfigError
from grpo_core.store.root import RunRoot

TOK = CharTokenizer()
ROWS = [{"question": f"{i}+{i}", "answer": str(2 * i)} for i in range(20)]


@pytest.fixture(autouse=True)
def offline(hub_offline):
    """Every test here: no Hub (tests/conftest.py)."""


def prep(tmp_path, **fields):
    cfg = DataConfig(**fields)
    root = RunRoot(str(tmp_path / "run"))
    return cfg, root, prepare_dataset(cfg, TOK, root, "char")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_synthetic_source_is_written_then_cached(tmp_path):
    cfg, root, m = prep(tmp_path, synthetic={"min_len": 3, "max_len": 3}, synthetic_rows=50, eval_rows=10)
    h = data_hash(cfg, "char")
    assert m["hash"] == h and not m["cached"] and (m["train_rows"], m["eval_rows"]) == (50, 10)
    assert root.list(f"data/{h}") == ["_SUCCESS", "eval.jsonl", "manifest.json", "train.jsonl"]
    train, evals = load_prepared(root, h)
    assert train[0]["prompt"].endswith("=") and train[0]["prompt_ids"] == TOK.encode(train[0]["prompt"])
    assert set(train[0]) == {"prompt", "prompt_ids", "answer"}
    before = root.read_bytes(f"data/{h}/train.jsonl")
    again = prepare_dataset(cfg, TOK, root, "char")
    assert again["cached"] and again["train_rows"] == 50 and root.read_bytes(f"data/{h}/train.jsonl") == before


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv"])
def test_file_sources_with_rename_and_template(tmp_path, fmt):
    path = tmp_path / f"rows.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, ROWS)
    elif fmt == "parquet":
        pd.DataFrame(ROWS).to_parquet(path)
    else:
        pd.DataFrame(ROWS).to_csv(path, index=False)
    _, root, m = prep(
        tmp_path, source=str(path), rename={"answer": "target"}, template="q: {question} =", eval_fraction=0.25
    )
    assert (m["train_rows"], m["eval_rows"]) == (15, 5)
    train, evals = load_prepared(root, m["hash"])
    row = (train + evals)[0]
    assert row["prompt"].startswith("q: ") and str(row["target"]) == str(eval(row["question"]))
    assert {r["question"] for r in train}.isdisjoint(r["question"] for r in evals)


def test_length_filter_counts_and_all_dropped_fails(tmp_path):
    rows = [{"prompt": "a" * n} for n in (2, 3, 9, 12, 4)]
    _, _, m = prep(tmp_path, source=write_jsonl(tmp_path / "p.jsonl", rows), max_prompt_tokens=4)
    assert m["dropped_too_long"] == 2 and m["train_rows"] + m["eval_rows"] == 3
    with pytest.raises(
        DataError,
        match=r"every one of 5 prompts is longer than data.max_prompt_tokens=1 "
        r"\(lengths 2..12 tokens\)",
    ):
        prep(tmp_path / "b", source=str(tmp_path / "p.jsonl"), max_prompt_tokens=1)


class ChatTokenizer(CharTokenizer):
    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        body = "".join(f"<{m['role'][0]}>{m['content']}" for m in messages)
        return body + ("<a>" if add_generation_prompt else "")


def test_chat_prompts_with_a_system_prompt(tmp_path):
    rows = [{"prompt": "1+1"}, {"prompt": [{"role": "user", "content": "2+2"}]}, {"prompt": "3+3"}]
    cfg = DataConfig(
        source=write_jsonl(tmp_path / "c.jsonl", rows), chat=True, system_prompt="be brief", eval_fraction=0.34
    )
    root = RunRoot(str(tmp_path / "run"))
    m = prepare_dataset(cfg, ChatTokenizer(), root, "chat")
    train, evals = load_prepared(root, m["hash"])
    assert sorted(r["prompt"] for r in train + evals) == [f"<s>be brief<u>{q}<a>" for q in ("1+1", "2+2", "3+3")]
    with pytest.raises(DataError, match="the tokenizer has no usable chat template"):
        prepare_dataset(cfg, TOK, RunRoot(str(tmp_path / "run2")), "char")


def test_hugging_face_folder_with_splits_and_subsets(tmp_path):
    folder = tmp_path / "ds"
    (folder / "easy").mkdir(parents=True)
    (folder / "hard").mkdir()
    write_jsonl(folder / "easy" / "train.jsonl", ROWS[:12])
    write_jsonl(folder / "easy" / "test.jsonl", ROWS[12:])
    write_jsonl(folder / "hard" / "train.jsonl", [{"question": "9*9", "answer": "81"}] * 3)
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: easy\n  data_files:\n  - split: train\n    path: easy/train.jsonl\n"
        "  - split: test\n    path: easy/test.jsonl\n- config_name: hard\n  data_files:\n  - split: train\n"
        "    path: hard/train.jsonl\n---\n"
    )
    _, root, m = prep(tmp_path, source=str(folder), subset="easy", eval_split="test", prompt_column="question")
    assert (m["train_rows"], m["eval_rows"]) == (12, 8)
    _, _, hard = prep(tmp_path / "h", source=str(folder), subset="hard", prompt_column="question")
    assert hard["train_rows"] + hard["eval_rows"] == 3
    with pytest.raises(DataError, match=r"cannot load dataset .* split 'validation'"):
        prep(tmp_path / "v", source=str(folder), subset="easy", eval_split="validation", prompt_column="question")


def test_saved_dataset_folder(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "saved"))
    _, _, m = prep(tmp_path, source=str(tmp_path / "saved"), prompt_column="question")
    assert m["train_rows"] + m["eval_rows"] == 20


@pytest.mark.parametrize(
    "setup, fields, message",
    [
        (lambda p: None, {"source": "{p}/missing.jsonl"}, "cannot read data file {p}/missing.jsonl"),
        (
            lambda p: (p / "bad.jsonl").write_text('{"prompt": "1"}\n{oops\n'),
            {"source": "{p}/bad.jsonl"},
            "{p}/bad.jsonl line 2 is not valid JSON",
        ),
        (
            lambda p: write_jsonl(p / "q.jsonl", ROWS),
            {"source": "{p}/q.jsonl"},
            "row 0 has no column 'prompt' (data.prompt_column); columns: ['answer', 'question']",
        ),
        (lambda p: (p / "e.jsonl").write_text(""), {"source": "{p}/e.jsonl"}, "{p}/e.jsonl has no rows"),
        (
            lambda p: write_jsonl(p / "t.jsonl", ROWS),
            {"source": "{p}/t.jsonl", "template": "{questio}"},
            "row 0: data.template uses column 'questio'",
        ),
        (
            lambda p: write_jsonl(p / "n.jsonl", [{"prompt": "1"}, {"prompt": 7}]),
            {"source": "{p}/n.jsonl"},
            "row 1: column 'prompt' must be text, got int",
        ),
        (
            lambda p: write_jsonl(p / "u.jsonl", [{"prompt": "1"}, {"prompt": "ABC"}]),
            {"source": "{p}/u.jsonl"},
            "row 1: the tokenizer cannot encode the prompt",
        ),
        (
            lambda p: write_jsonl(p / "one.jsonl", [{"prompt": "1"}]),
            {"source": "{p}/one.jsonl"},
            "1 usable row(s); a train and an eval split need at least 2",
        ),
        (
            lambda p: (p / "rows.txt").write_text("1+1\n"),
            {"source": "{p}/rows.txt"},
            "data.source {p}/rows.txt: unsupported file type",
        ),
        (
            lambda p: (p / "a.json").write_text("[1, 2]"),
            {"source": "{p}/a.json"},
            "{p}/a.json must hold a JSON array of objects",
        ),
    ],
)
def test_bad_data_names_the_place_and_marks_nothing(tmp_path, setup, fields, message):
    setup(tmp_path)
    fields = {k: v.replace("{p}", str(tmp_path)) for k, v in fields.items()}
    cfg = DataConfig(**fields)
    root = RunRoot(str(tmp_path / "run"))
    with pytest.raises(DataError) as err:
        prepare_dataset(cfg, TOK, root, "char")
    assert message.format(p=tmp_path) in str(err.value)
    assert not root.is_done(f"data/{data_hash(cfg, 'char')}")
    with pytest.raises(DataError, match="is not complete"):
        load_prepared(root, data_hash(cfg, "char"))


def test_saved_single_dataset_has_no_eval_split(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(DataError, match="is a single saved Dataset without splits, so split 'test' does not exist"):
        prep(tmp_path, source=str(tmp_path / "one"), prompt_column="question", eval_split="test")


def test_csv_is_text_and_odd_values_become_json(tmp_path):
    (tmp_path / "n.csv").write_text("prompt,answer,score\n12,24,\n7,14,0.5\n3,6,1\n")
    _, root, m = prep(tmp_path, source=str(tmp_path / "n.csv"), eval_fraction=0.34)
    train, evals = load_prepared(root, m["hash"])
    assert sorted(r["prompt"] for r in train + evals) == ["12", "3", "7"]  # not ints
    frame = pd.DataFrame(
        {"prompt": ["1", "2", "3"], "t": pd.to_datetime(["2026-01-01"] * 3), "x": [float("nan"), 1.0, 2.0]}
    )
    frame.to_parquet(tmp_path / "odd.parquet")
    _, root, m = prep(tmp_path / "b", source=str(tmp_path / "odd.parquet"), eval_fraction=0.34)
    rows = sum(load_prepared(root, m["hash"]), [])
    assert {r["t"] for r in rows} == {"2026-01-01T00:00:00"} and None in {r["x"] for r in rows}


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="data.eval_fraction must be in"):
        DataConfig(eval_fraction=0.95)
    with pytest.raises(ConfigError, match="data.eval_split applies to Hugging Face datasets"):
        DataConfig(source="x.jsonl", eval_split="test")
    with pytest.raises(ConfigError, match="data.synthetic: .*min_len"):
        DataConfig(synthetic={"min_len": 5, "max_len": 2})
    # issue 28 (A16): said as a field, not as ReverseTask.__init__'s unexpected keyword argument
    with pytest.raises(ConfigError, match=r"^data\.synthetic: unknown key\(s\) \['size'\]; known: \['alphabet', "):
        DataConfig(synthetic={"size": 5})
    with pytest.raises(ConfigError, match=r"placeholders must be column names like \{question\}, .*; got '\{\}'"):
        DataConfig(template="Q: {}")
    with pytest.raises(ConfigError, match="got '{prompt.x}'"):
        DataConfig(template="{prompt.x}")
    with pytest.raises(ConfigError, match="is not a valid format string"):
        DataConfig(template="{prompt =")


def test_dataset_prompts_walk_the_rows_deterministically():
    rows = [{"prompt": str(i)} for i in range(10)]
    a, b = DatasetPrompts(rows, seed=3), DatasetPrompts(rows, seed=3)
    first_epoch = [r["prompt"] for s in range(5) for r in a.sample(s, 0, 2)]
    assert sorted(first_epoch) == sorted(r["prompt"] for r in rows)  # every row once per epoch
    assert [r["prompt"] for r in b.sample(7, 0, 4)] == [r["prompt"] for r in a.sample(7, 0, 4)]
    assert a.sample(3, 1, 4) == b.sample(3, 1, 4) and len(a.sample(3, 2, 4)) == 4
    with pytest.raises(ValueError):
        DatasetPrompts([])
