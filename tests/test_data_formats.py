"""Datasets users bring: GSM8K rows (question, answer ending in '#### 42'), verl's RL Parquet
(chat-message prompts, reward_model.ground_truth), chat messages in any format, a hub-layout
dataset folder read through the same `datasets.load_dataset` call as a hub id, and the data
hash of configs written before data.format existed. No network: everything is built here."""

import json

import pandas as pd
import pytest

from grpo_core.config.run import RewardSpec, RunConfig
from grpo_core.data.formats import DataFormat, detect, gsm8k_truth
from grpo_core.data.prepare import DataConfig, DataError, data_hash, load_prepared, prepare_dataset
from grpo_core.data.synthetic import CharTokenizer
from grpo_core.errors import ConfigError
from grpo_core.rewards.functions import score
from grpo_core.rewards.registry import make_rewards
from grpo_core.store.root import RunRoot, config_hash
from tests.hf_models import save_tokenizer

TOK = CharTokenizer()


@pytest.fixture(autouse=True)
def offline(hub_offline):
    """Every test here: no Hub (tests/conftest.py)."""


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    """A character-level HF tokenizer with a Qwen-style chat template (tests/hf_models.py),
    in the wrapper a run uses for model.tokenizer."""
    from grpo_core.store.sources import HFTokenizer

    folder = tmp_path_factory.mktemp("tok")
    save_tokenizer(folder)
    return HFTokenizer(str(folder))


def gsm8k_rows(n=20):
    """GSM8K's shape: a word problem and a worked solution whose last line is '#### <answer>'."""
    return [
        {
            "question": f"tom has {i} apples and buys {1000 + i} more. how many now?",
            "answer": f"He has {i} + {1000 + i} = <<{i}+{1000 + i}={1000 + 2 * i}>>{1000 + 2 * i} apples.\n"
            f"#### {1000 + 2 * i:,}",
        }
        for i in range(n)
    ]


def verl_rows(n=12):
    """verl's RL Parquet: prompt messages, reward_model.ground_truth, data_source and extra_info."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} times 3?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(3 * i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def prep(tmp_path, tokenizer=TOK, tokenizer_id="char", **fields):
    cfg = DataConfig(**fields)
    root = RunRoot(str(tmp_path / "run"))
    m = prepare_dataset(cfg, tokenizer, root, tokenizer_id)
    train, evals = load_prepared(root, m["hash"])
    return m, train + evals


def test_gsm8k_rows_are_detected_and_give_a_ground_truth(tmp_path):
    m, rows = prep(tmp_path, source=write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows()), max_prompt_tokens=128)
    assert m["format"] == "gsm8k" and m["train_rows"] + m["eval_rows"] == 20
    row = next(r for r in rows if r["prompt"].startswith("tom has 7 "))
    assert row["ground_truth"] == "1014"  # after the last '####', thousands separator gone
    assert row["answer"].endswith("#### 1,014") and "question" not in row  # the solution stays
    assert set(row) == {"prompt", "prompt_ids", "answer", "ground_truth"}
    # A template over the question works the same way; explicit plain reads no answer.
    _, rows = prep(
        tmp_path / "t", source=str(tmp_path / "gsm8k.jsonl"), template="q: {question} a:", max_prompt_tokens=128
    )
    assert all(r["prompt"].startswith("q: tom") and r["ground_truth"] for r in rows)
    _, rows = prep(
        tmp_path / "p",
        source=str(tmp_path / "gsm8k.jsonl"),
        format="plain",
        prompt_column="question",
        max_prompt_tokens=128,
    )
    assert "ground_truth" not in rows[0]


def test_gsm8k_truth_and_detection():
    assert gsm8k_truth("a #### b\n#### 1,234 \n") == "1234"
    assert gsm8k_truth("#### -3.5") == "-3.5"
    with pytest.raises(ValueError, match=r"answer has no '#### <number>'"):
        gsm8k_truth("42")
    with pytest.raises(ValueError, match="nothing after its last '####'"):
        gsm8k_truth("so ####  ")
    assert detect({"question": "q", "answer": "x #### 4"}, "prompt") is DataFormat.GSM8K
    assert detect({"question": "q", "answer": "4"}, "prompt") is DataFormat.PLAIN  # no '####': plain
    msgs = [{"role": "user", "content": "q"}]
    assert detect({"prompt": msgs, "reward_model": {"ground_truth": "4"}}, "prompt") is DataFormat.VERL
    assert detect({"prompt": msgs, "ground_truth": "4"}, "prompt") is DataFormat.VERL
    assert detect({"prompt": msgs}, "prompt") is DataFormat.PLAIN  # messages without a reference
    assert detect({"prompt": "text", "ground_truth": "4"}, "prompt") is DataFormat.PLAIN


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "row 17: answer has no '#### <number>' (data.format=gsm8k): '17 apples' (or set data.format=plain)"),
        ({"format": "gsm8k"}, "row 17: answer has no '#### <number>' (data.format=gsm8k): '17 apples'"),
    ],
)
def test_a_bad_gsm8k_row_is_named(tmp_path, fields, message):
    rows = gsm8k_rows()
    rows[17]["answer"] = "17 apples"
    cfg = DataConfig(source=write_jsonl(tmp_path / "g.jsonl", rows), max_prompt_tokens=128, **fields)
    root = RunRoot(str(tmp_path / "run"))
    with pytest.raises(DataError) as err:
        prepare_dataset(cfg, TOK, root, "char")
    assert str(err.value) == f"{tmp_path}/g.jsonl {message}"
    assert root.list("data") == [] or not any(root.is_done(f"data/{h}") for h in root.list("data"))


def test_gsm8k_format_needs_its_columns(tmp_path):
    write_jsonl(tmp_path / "q.jsonl", [{"prompt": "1+1", "answer": "#### 2"}] * 3)
    with pytest.raises(DataError, match=r"q.jsonl row 0 has no column 'question' \(data.format=gsm8k\)"):
        prep(tmp_path, source=str(tmp_path / "q.jsonl"), format="gsm8k", prompt_column="problem")


def test_verl_parquet_through_the_chat_template(tmp_path, hf_tok):
    rows = verl_rows()
    rows[3]["prompt"] = [{"role": "system", "content": "Use digits."}, *rows[3]["prompt"]]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    m, out = prep(
        tmp_path,
        hf_tok,
        "hf:tok",
        source=str(tmp_path / "train.parquet"),
        system_prompt="Be brief.",
        max_prompt_tokens=128,
        eval_fraction=0.25,
    )
    assert m["format"] == "verl" and (m["train_rows"], m["eval_rows"]) == (9, 3)
    by_index = {r["extra_info"]["index"]: r for r in out}
    assert by_index[5]["prompt"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 5 times 3?"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert by_index[3]["prompt"].startswith("<|im_start|>system\nUse digits.<|im_end|>")  # its own system message
    assert by_index[5]["prompt_ids"] == hf_tok.encode(by_index[5]["prompt"])
    assert by_index[5]["ground_truth"] == "15" and by_index[5]["data_source"] == "openai/gsm8k"
    assert by_index[5]["extra_info"] == {"split": "train", "index": 5}
    assert by_index[5]["reward_model"] == {"style": "rule", "ground_truth": "15"}


def test_verl_top_level_ground_truth_and_missing_one(tmp_path, hf_tok):
    rows = verl_rows(4)
    for r in rows:
        r["ground_truth"] = r.pop("reward_model")["ground_truth"]
    rows[1]["ground_truth"] = 42  # a number becomes text: one type per column
    _, out = prep(
        tmp_path,
        hf_tok,
        "hf:tok",
        source=write_jsonl(tmp_path / "v.jsonl", rows),
        max_prompt_tokens=128,
        eval_fraction=0.25,
    )
    assert sorted(r["ground_truth"] for r in out) == ["0", "42", "6", "9"]
    del rows[2]["ground_truth"]
    with pytest.raises(
        DataError,
        match=r"v2.jsonl row 2 has no 'ground_truth' column nor reward_model.ground_truth "
        r"\(data.format=verl\)",
    ):
        prep(
            tmp_path / "b",
            hf_tok,
            "hf:tok",
            source=write_jsonl(tmp_path / "v2.jsonl", rows),
            format="verl",
            max_prompt_tokens=128,
        )


def test_chat_messages_use_the_template_in_plain_format(tmp_path, hf_tok):
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}"}], "answer": str(2 * i)} for i in range(4)]
    rows.append({"prompt": "4+4", "answer": "8"})  # text stays text without data.chat
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    _, out = prep(tmp_path, hf_tok, "hf:tok", source=path, max_prompt_tokens=64, eval_fraction=0.2)
    prompts = sorted(r["prompt"] for r in out)
    assert prompts[0] == "4+4" and prompts[1] == "<|im_start|>user\n0+0<|im_end|>\n<|im_start|>assistant\n"
    # chat rows keep their messages for reward functions (TRL's conversational format); text rows have none
    by_prompt = {r["prompt"]: r for r in out}
    assert by_prompt[prompts[1]]["prompt_messages"] == [{"role": "user", "content": "0+0"}]
    assert by_prompt["4+4"].get("prompt_messages") is None
    with pytest.raises(
        DataError,
        match=r"m.jsonl row 0: column 'prompt' holds chat messages, but the tokenizer "
        r"has no usable chat template",
    ):
        prep(tmp_path / "c", source=path)
    write_jsonl(tmp_path / "e.jsonl", [{"prompt": [{"text": "x"}]}, {"prompt": "x"}])  # [] is empty: dropped
    with pytest.raises(
        DataError,
        match=r"e.jsonl row 0: column 'prompt': a chat prompt must be text or a "
        r"non-empty list of \{role, content\} messages",
    ):
        prep(tmp_path / "e", hf_tok, "hf:tok", source=str(tmp_path / "e.jsonl"), chat=True)


def test_hub_layout_folder_with_subset_and_split(tmp_path):
    """openai/gsm8k's layout on the hub: {main,socratic}/{train,test}-*.parquet and a README whose
    YAML names the configs. load_dataset reads a folder through the same call as a hub id."""
    import datasets

    folder = tmp_path / "gsm8k"
    rows = gsm8k_rows(30)
    for subset in ("main", "socratic"):
        (folder / subset).mkdir(parents=True)
        for split, part in (("train", rows[:24]), ("test", rows[24:])):
            if subset == "socratic":
                part = [dict(r, question=r["question"] + " think step by step.") for r in part]
            datasets.Dataset.from_list(part).to_parquet(str(folder / subset / f"{split}-00000-of-00001.parquet"))
    (folder / "README.md").write_text(
        "---\nconfigs:\n"
        + "".join(
            f"- config_name: {s}\n  data_files:\n  - split: train\n    path: {s}/train-*\n"
            f"  - split: test\n    path: {s}/test-*\n"
            for s in ("main", "socratic")
        )
        + "---\n"
    )
    m, out = prep(tmp_path, source=str(folder), subset="main", split="train", eval_split="test", max_prompt_tokens=128)
    assert m["format"] == "gsm8k" and (m["train_rows"], m["eval_rows"]) == (24, 6)
    train, evals = load_prepared(RunRoot(str(tmp_path / "run")), m["hash"])
    assert sorted(int(r["ground_truth"]) for r in evals) == [1000 + 2 * i for i in range(24, 30)]
    m2, out2 = prep(tmp_path / "s", source=str(folder), subset="socratic", split="test", max_prompt_tokens=128)
    assert m2["train_rows"] + m2["eval_rows"] == 6 and all(r["prompt"].endswith("step by step.") for r in out2)
    with pytest.raises(DataError, match=r"cannot load dataset .* subset 'main' split 'validation'"):
        prep(tmp_path / "v", source=str(folder), subset="main", split="validation")


def test_rows_share_their_columns_and_unstorable_ones_are_dropped(tmp_path):
    rows = [{"prompt": "1", "a": 1}, {"prompt": "2", "b": "x"}, {"prompt": "3"}]
    _, out = prep(tmp_path, source=write_jsonl(tmp_path / "r.jsonl", rows), eval_fraction=0.34)
    assert all(set(r) == {"prompt", "prompt_ids", "a", "b"} for r in out)  # None where a row lacks one
    pd.DataFrame({"prompt": ["1", "2", "3"], "blob": [b"\x00", b"\x01", b"\x02"]}).to_parquet(tmp_path / "b.parquet")
    m, out = prep(tmp_path / "b", source=str(tmp_path / "b.parquet"), eval_fraction=0.34)
    assert m["dropped_columns"] == ["blob"] and all("blob" not in r for r in out)


def test_format_in_config_and_hash():
    with pytest.raises(ConfigError, match="data.format must be one of auto, plain, gsm8k, verl; got 'gsm'"):
        DataConfig(source="x.jsonl", format="gsm")
    with pytest.raises(ConfigError, match="data.format=gsm8k applies to a dataset"):
        DataConfig(format="gsm8k")
    base = DataConfig(source="x.jsonl")
    assert base.format is DataFormat.AUTO and base.to_dict()["format"] == "auto"
    # The default is left out of the hash: configs written before data.format keep their data
    # hash (and so their training hash and checkpoints).
    before = {k: v for k, v in base.to_dict().items() if k not in ("format", "eval_source")}  # added later
    assert data_hash(base, "char") == config_hash({"data": before, "tokenizer": "char"})
    hashes = {data_hash(base.replace(format=f), "char") for f in ("auto", "plain", "gsm8k", "verl")}
    assert len(hashes) == 4
    old = RunConfig.from_dict({"data": {"source": "x.jsonl"}})  # an older config.json has no data.format
    assert old.data_hash == RunConfig.from_dict({"data": {"source": "x.jsonl", "format": "auto"}}).data_hash


def test_prepared_gsm8k_and_verl_rows_score_with_math_answer(tmp_path, hf_tok):
    """End to end: prepare both shapes with a Hugging Face tokenizer, then score a right and a
    wrong completion per row with the built-in reward, as the trainer does."""
    rewards = make_rewards((RewardSpec(function="math_answer"), RewardSpec(function="think_format", weight=0.5)))
    write_jsonl(tmp_path / "g.jsonl", gsm8k_rows(6))
    pd.DataFrame(verl_rows(6)).to_parquet(tmp_path / "v.parquet")
    for source in ("g.jsonl", "v.parquet"):
        _, rows = prep(
            tmp_path / f"run-{source}",
            hf_tok,
            "hf:tok",
            source=str(tmp_path / source),
            chat=True,
            max_prompt_tokens=128,
            eval_fraction=0.34,
        )
        truths = [r["ground_truth"] for r in rows]
        right = [f"<think>easy</think><answer>{int(t):,}</answer>" for t in truths]  # '1,014' is 1014
        wrong = [f"The answer is \\boxed{{{int(t) + 1}}}" for t in truths]
        columns = {k: [r[k] for r in rows] * 2 for k in rows[0] if k not in ("prompt", "prompt_ids")}
        res = score(rewards, [r["prompt"] for r in rows] * 2, right + wrong, columns)
        n = len(rows)
        assert list(res.per_function["math_answer"]) == [1.0] * n + [0.0] * n
        assert list(res.total) == [1.5] * n + [0.0] * n


def test_the_reward_probe_says_what_it_compared(tmp_path):
    """issue 53: "reward probe: 'char_match' scored 32/32" read as all-clear where the synthetic
    task's reward compared each reference answer with GSM8K's whole worked solution. The probe
    says which reference it gave the reward and how that scored."""
    from grpo_core.config.run import load_config
    from grpo_core.resolve import resolve_run
    from grpo_core.rewards.probe import check_coverage
    from grpo_core.rewards.registry import config_rewards

    source = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows(40))
    sets = [f"storage.root={tmp_path}", f"data.source={source}", "data.eval_fraction=0.2", "data.max_prompt_tokens=128"]
    cfg = resolve_run(load_config(None, sets))  # no rewards: math_answer, the data has a reference
    m = prepare_dataset(cfg.data, TOK, RunRoot(str(tmp_path / "run")), "char")
    train, evals = load_prepared(RunRoot(str(tmp_path / "run")), m["hash"])
    assert (len(train), len(evals)) == (32, 8)
    found = check_coverage(cfg, *config_rewards(cfg), train, evals, m["format"])
    assert [c.describe() for c in found] == [
        "'math_answer': 32/32 sampled training rows hold a reference answer (ground_truth); given it as the "
        "completion, the reward scored 32/32, mean 1",
        "'math_answer': 8/8 sampled evaluation rows hold a reference answer (ground_truth); given it as the "
        "completion, the reward scored 8/8, mean 1",
    ]
    # the measured case: char_match against `answer`, the worked solution; the mean says it
    [char] = check_coverage(cfg, make_rewards((RewardSpec(function="char_match"),)), [], train, [], "gsm8k")
    assert char.scored == 32 and char.mean < 0.1 and f"the reward scored 32/32, mean {char.mean:.3g}" in char.describe()


def test_a_messages_file_with_a_solution_trains_with_no_setting(tmp_path, hf_tok):
    """A chat export, `{"messages": [...], "solution": "72"}` (issue 65 item 3): with no `prompt`
    column the conversation is the prompt, up to its last user turn (the assistant's answer is what
    the policy is to write), and `solution` is the reference answer TRL's math datasets name, so
    math_answer is chosen by default and scores against it; nothing to set."""
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"{i}+{i}?"},
                {"role": "assistant", "content": f"{2 * i}"},
            ],
            "solution": str(2 * i),
        }
        for i in range(6)
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    _, out = prep(tmp_path, hf_tok, "hf:tok", source=path, max_prompt_tokens=64, eval_fraction=0.2)
    one = next(r for r in out if r["solution"] == "6")
    assert (
        one["prompt"]
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert one["prompt_messages"][-1] == {"role": "user", "content": "3+3?"} and one["ground_truth"] == "6"
    assert detect(rows[0], "prompt") is DataFormat.PLAIN
    cfg = RunConfig.from_dict({"data": {"source": path}})
    from grpo_core.resolve import resolve_run

    chosen = resolve_run(cfg).rewards_default
    assert [s.function for s in cfg.rewards] == ["math_answer"] and "its solution column" in chosen.why
    scored = score(
        make_rewards(cfg.rewards),
        [one["prompt_messages"]],
        [[{"role": "assistant", "content": "6"}]],
        {"ground_truth": ["6"]},
    )
    assert scored.total.tolist() == [1.0]
    write_jsonl(tmp_path / "only.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}] * 3)
    with pytest.raises(DataError, match=r"only.jsonl row 0: column 'messages' holds only assistant messages"):
        prep(tmp_path / "o", hf_tok, "hf:tok", source=str(tmp_path / "only.jsonl"))
