"""Prepared data and runs keyed by what the sources hold, not only where they are: a data file
rewritten in place (locally and on the GCS emulator), a model folder rebuilt, a Hub id with and
without a pinned revision. Under run_name: null new content is a new run; under a fixed run_name
it is refused, naming what changed; a run started before inputs were versioned still resumes."""

import json

import pytest

from grpo_core.config.run import RunConfig, load_config
from grpo_core.data.prepare import prepare_dataset
from grpo_core.data.tokenizer import make_tokenizer
from grpo_core.errors import ConfigError
from grpo_core.resolve import resolve_run
from grpo_core.store.root import RunRoot
from grpo_core.store.runs import init_run_root
from grpo_core.store.versions import version_of


def _rows(n: int) -> str:
    return "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(n))


def _config(root: str, source: str, *sets: str) -> RunConfig:
    base = [f"storage.root={root}", f"data.source={source}", "data.format=plain", "data.max_prompt_tokens=64"]
    base.append("rewards=[exact_match]")  # prompt and answer rows: no default reward fits them (issue 53)
    return resolve_run(load_config(None, [*base, "data.eval_rows=2", *sets]))


def _check_both_behaviours(root: str, source: str, rewrite) -> None:
    first = _config(root, source)
    m1 = prepare_dataset(
        first.data, make_tokenizer(first), init_run_root(first), first.tokenizer_id, first.data_versions
    )
    named = _config(root, source, "run_name=nightly")
    init_run_root(named).write_metrics([{"step": 0.0, "reward": 0.0}])  # it trained: its name is its own
    rewrite()
    again = _config(root, source)
    # run_name: null: new content is another data key and another run
    assert again.versions != first.versions and again.data_hash != first.data_hash and again.name != first.name
    root2 = init_run_root(again)
    m2 = prepare_dataset(again.data, make_tokenizer(again), root2, again.tokenizer_id, again.data_versions)
    assert m2["hash"] != m1["hash"] and m2["train_rows"] + m2["eval_rows"] == 12 and not m2.get("cached")
    assert RunRoot(again.run_url).read_json("config.json")["versions"]["data.source"] == again.versions[0][1]
    assert m2["versions"] == {"data.source": dict(again.versions)["data.source"]}
    # a fixed run_name: refused, naming the field and both versions
    with pytest.raises(ConfigError, match=r"started on other inputs: data\.source: '.+' -> '.+'"):
        init_run_root(_config(root, source, "run_name=nightly"))


def test_a_local_file_rewritten_in_place(tmp_path):
    source = tmp_path / "prompts.jsonl"
    source.write_text(_rows(8))
    _check_both_behaviours(str(tmp_path / "runs"), str(source), lambda: source.write_text(_rows(12)))


def test_a_gcs_object_uploaded_again(gcs_emulator, tmp_path):
    import fsspec

    url = gcs_emulator.url_for("data") + "/prompts.jsonl"
    with fsspec.open(url, "w") as f:
        f.write(_rows(8))
    v1 = version_of(url)
    assert v1.startswith("generation:")

    def upload_again():
        with fsspec.open(url, "w") as f:
            f.write(_rows(12))

    _check_both_behaviours(str(tmp_path / "runs"), url, upload_again)


def test_same_content_same_run_and_a_model_folder_rebuilt(tmp_path):
    source = tmp_path / "prompts.jsonl"
    source.write_text(_rows(8))
    assert _config(str(tmp_path), str(source)).name == _config(str(tmp_path), str(source)).name
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    before = version_of(str(folder))
    (folder / "model.safetensors").write_bytes(b"weights")
    assert version_of(str(folder)) != before and version_of(str(folder)).startswith("files:")
    assert version_of(str(tmp_path / "missing.jsonl")) is None  # the stage that reads it says so


def test_hub_ids_pinned_and_unresolved(tmp_path, hub_offline):
    assert version_of("Qwen/Qwen3-0.6B", "0" * 40) == "commit:" + "0" * 40
    assert version_of("openai/gsm8k", None, "dataset") == "unresolved@main"
    warnings = []
    cfg = load_config(None, [f"storage.root={tmp_path}", "data.source=openai/gsm8k", "data.subset=main"])
    cfg = resolve_run(cfg, warn=warnings.append)
    assert dict(cfg.versions) == {"data.source": "unresolved@main"}
    assert len(warnings) == 1 and "data.source 'openai/gsm8k'" in warnings[0] and "pin" in warnings[0]


def test_a_run_started_before_inputs_were_versioned_resumes(tmp_path):
    source = tmp_path / "prompts.jsonl"
    source.write_text(_rows(8))
    sets = [f"storage.root={tmp_path}", f"data.source={source}", "data.format=plain", "run_name=old"]
    sets.append("rewards=[exact_match]")  # prompt and answer rows: no default reward fits them (issue 53)
    sets.append("train.num_steps=8")  # a number, as every run from before versions (and before num_steps: auto)
    old = load_config(None, sets)  # no versions: as config.json was written before them
    init_run_root(old)
    root = init_run_root(resolve_run(old))
    assert "versions" not in root.read_json("config.json")  # keeps its hashes: its checkpoints stay its own
    assert RunConfig.from_dict(root.read_json("config.json")).train_hash == old.train_hash


def test_an_unreachable_gs_source_fails_at_once_naming_the_field(tmp_path, monkeypatch):
    from grpo_core.errors import StorageError

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # nothing listens there
    cfg = load_config(None, [f"storage.root={tmp_path}", "data.source=gs://bucket/prompts.jsonl"])
    with pytest.raises(StorageError, match=r"data\.source gs://bucket/prompts\.jsonl: cannot reach"):
        resolve_run(cfg)


def test_an_edited_reward_file_is_a_new_run_or_a_refusal_naming_it(tmp_path):
    """The run's identity holds what its reward file says (a digest of its content), not only its
    path: the same config after an edit of the file is a new run under run_name: null, and under
    a fixed run_name a refusal naming the file; the same content again is the same run. A
    built-in reward has no file: the demo's hashes do not move. A run started before code was
    versioned by content resumes."""
    data = tmp_path / "d.jsonl"
    data.write_text(_rows(8))
    reward = tmp_path / "rewards" / "mine.py"
    reward.parent.mkdir()
    reward.write_text("def score(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    spec = f"rewards=[{{function: '{reward}:score'}}]"
    first = _config(str(tmp_path / "runs"), str(data), spec)
    assert dict(first.versions)["rewards[0].function"].startswith("sha256:")
    assert "rewards[0].function" in json.dumps(first.to_dict()["versions"])  # recorded in config.json
    named = _config(str(tmp_path / "runs"), str(data), spec, "run_name=mine")
    init_run_root(named).write_metrics([{"step": 0.0, "reward": 0.0}])  # it trained: its name is its own
    reward.write_text("def score(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    edited = _config(str(tmp_path / "runs"), str(data), spec)
    assert edited.train_hash != first.train_hash and edited.name != first.name
    assert edited.eval_hash != first.eval_hash  # the evaluation scores with it too
    assert edited.data_hash == first.data_hash  # the prepared data does not depend on it
    with pytest.raises(ConfigError) as err:
        init_run_root(_config(str(tmp_path / "runs"), str(data), spec, "run_name=mine"))
    assert "was started on other inputs: rewards[0].function: " in str(err.value)
    assert f"edited code: {reward}" in str(err.value)
    reward.write_text("def score(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    init_run_root(_config(str(tmp_path / "runs"), str(data), spec, "run_name=mine"))  # the same content again
    # a run whose config.json was written before code versions existed resumes with its own config
    old = dict(named.to_dict(), versions={k: v for k, v in named.versions if not k.startswith("rewards[")})
    RunRoot(named.run_url).write_json("config.json", old)
    init_run_root(named)
    assert "rewards[0].function" not in RunRoot(named.run_url).read_json("config.json")["versions"]
    demo = resolve_run(load_config(None, []))
    assert not demo.code_versions("rewards[", "eval.rewards[")
    assert demo.train_hash == load_config(None, []).train_hash


def test_check_and_run_agree_on_a_run_name_and_a_failed_start_gives_it_up(tmp_path):
    """(issue 65 item 1) `grpo check` said ready, then `grpo run` refused the run name (another
    config's). The check now says what the run would: and a run that failed before its first step
    (nothing trained) gives its name to the corrected config, nothing of it lost."""
    from tasks.readiness import _run_check

    data = tmp_path / "d.jsonl"
    data.write_text(_rows(8))
    first = _config(str(tmp_path / "runs"), str(data), "run_name=mine")
    init_run_root(first)  # started, then failed in its data stage: no checkpoint, no metrics
    fixed = _config(str(tmp_path / "runs"), str(data), "run_name=mine", "data.max_prompt_tokens=32")
    assert fixed.train_hash != first.train_hash
    assert _run_check(fixed)["ok"]
    init_run_root(fixed)
    assert RunRoot(fixed.run_url).read_json("config.json")["hashes"]["train"] == fixed.train_hash
    RunRoot(fixed.run_url).write_metrics([{"step": 0.0, "reward": 0.5}])  # now it trained
    check = _run_check(first)
    assert not check["ok"] and "was started with another config" in check["detail"]
    assert "run_name" in check["fix"]
    with pytest.raises(ConfigError, match="was started with another config"):
        init_run_root(first)
