"""Tokenizers as users save them (issue 29): `model.tokenizer` as a folder holding only what
`PreTrainedTokenizerFast.save_pretrained` writes, a Hub id (an offline Hub cache laid out as
huggingface_hub writes it) or a URL; every error names model.tokenizer; the built-in character
tokenizer says what to set when text falls outside its alphabet, and `grpo check` finds such
data before any run starts."""

import json
import os
import shutil

import pytest

pytest.importorskip("transformers")

from flows.cli import main  # noqa: E402
from grpo_core.config.run import RunConfig  # noqa: E402
from grpo_core.data.prepare import EncodeError, dry_run  # noqa: E402
from grpo_core.data.synthetic import CharTokenizer  # noqa: E402
from grpo_core.data.tokenizer import make_tokenizer  # noqa: E402
from grpo_core.errors import ConfigError  # noqa: E402
from grpo_core.store.sources import resolve_tokenizer  # noqa: E402
from tests.hf_models import hub_cache, run_offline, save_bpe_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok") / "my-tokenizer"
    tok = save_bpe_tokenizer(folder, chat=False)
    assert not (folder / "config.json").exists()
    return folder, tok


def gsm8k_rows(path, n=12):
    path.write_text(
        "".join(
            json.dumps(
                {"question": f"Natalia sold {i} clips in April. How many?", "answer": f"She sold {i}.\n#### {i}"}
            )
            + "\n"
            for i in range(n)
        )
    )
    return path


def test_a_tokenizer_folder_without_config_json_is_the_runs_tokenizer(tok_folder, tmp_path):
    folder, tok = tok_folder
    cfg = RunConfig.from_dict(
        {
            "model": {"preset": "tiny", "tokenizer": str(folder)},
            "data": {"source": str(gsm8k_rows(tmp_path / "g.jsonl"))},
        }
    )
    t = make_tokenizer(cfg)
    assert t.vocab_size == len(tok) and t.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert t.encode("Natalia sold 3") == tok.encode("Natalia sold 3", add_special_tokens=False)
    assert t.decode(t.encode("Ünïcode ✓ text")) == "Ünïcode ✓ text"  # byte-level: any UTF-8
    assert cfg.tokenizer_id == f"hf:{folder}" and cfg.model_config(vocab_size=t.vocab_size).vocab_size == len(tok)
    got = dry_run(cfg.data, t)
    assert got["train_rows"] + got["eval_rows"] == 12 and got["format"] == "gsm8k"


def test_tokenizer_errors_name_model_tokenizer(tok_folder, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights-only").mkdir()
    (tmp_path / "weights-only" / "config.json").write_text("{}")
    broken = tmp_path / "broken"
    shutil.copytree(tok_folder[0], broken)
    (broken / "tokenizer.json").write_text("{not json")
    cases = {
        str(tmp_path / "nope"): "does not exist",
        str(tmp_path / "empty"): "none of tokenizer.json, tokenizer_config.json",
        str(tmp_path / "weights-only"): "none of tokenizer.json",
        str(broken): "cannot load a tokenizer from",
        "not a valid id!": "neither an existing folder",
    }
    for where, why in cases.items():
        cfg = RunConfig.from_dict({"model": {"preset": "tiny", "tokenizer": where}})
        with pytest.raises(ConfigError) as exc:
            make_tokenizer(cfg)
        assert str(exc.value).startswith("model.tokenizer") and why in str(exc.value), str(exc.value)
        assert "model.path" not in str(exc.value)


def test_a_tokenizer_url_needs_no_config_json(tok_folder, monkeypatch, tmp_path):
    import fsspec

    monkeypatch.setenv("GRPO_MODEL_CACHE", str(tmp_path / "cache"))
    fs = fsspec.filesystem("memory")
    for name in os.listdir(tok_folder[0]):
        fs.pipe(f"/tok29/{name}", (tok_folder[0] / name).read_bytes())
    local = resolve_tokenizer("memory://tok29")
    assert sorted(os.listdir(local)) == [".sources.json", "tokenizer.json", "tokenizer_config.json"]
    fs.pipe("/notok29/README.md", b"hello")
    with pytest.raises(ConfigError, match=r"^model.tokenizer memory://notok29 has none of tokenizer.json.*README"):
        resolve_tokenizer("memory://notok29")


def test_a_hub_id_loads_a_tokenizer_only_repo_offline(tok_folder, tmp_path):
    """The Hub path of model.tokenizer: snapshot_download through a cache laid out as
    huggingface_hub writes it (a repository holding tokenizer files alone), HF_HUB_OFFLINE=1."""
    hub_cache(tmp_path / "hub", "acme/tok", tok_folder[0], "1" * 40)
    code = (
        "import json; from grpo_core.config.run import RunConfig; from grpo_core.data.tokenizer import make_tokenizer\n"
        "from grpo_core.store.root import StorageError\n"
        "t = make_tokenizer(RunConfig.from_dict({'model': {'preset': 'tiny', 'tokenizer': 'acme/tok'}}))\n"
        "out = {'vocab': t.vocab_size, 'ids': t.encode('Natalia sold 3')}\n"
        "try:\n    make_tokenizer(RunConfig.from_dict({'model': {'preset': 'tiny', 'tokenizer': 'acme/absent'}}))\n"
        "except StorageError as e:\n    out['absent'] = str(e)\n"
        "print(json.dumps(out))"
    )
    out = run_offline(code, tmp_path / "hub")
    assert out["vocab"] == len(tok_folder[1]) and out["ids"] == tok_folder[1].encode("Natalia sold 3")
    assert out["absent"].startswith("model.tokenizer 'acme/absent' is not in the Hugging Face cache")


def test_the_character_tokenizer_says_what_to_set():
    with pytest.raises(ValueError) as exc:
        CharTokenizer().encode("What is 2+2?")
    msg = str(exc.value)
    assert "character 'W'" in msg and "--set model.tokenizer=Qwen/Qwen2.5-0.5B-Instruct" in msg
    assert "tokenizer.json" in msg and "model.path" in msg


def test_the_character_tokenizers_export_is_what_transformers_reads_and_writes(tmp_path):
    """An export's tokenizer files, written without transformers: AutoTokenizer reads them as the
    same tokenizer (ids, <eos> as end and padding, special tokens skipped in decoding), and reads
    them exactly as it reads the folder its own PreTrainedTokenizerFast.save_pretrained writes."""
    import transformers
    from tokenizers import Tokenizer

    ours = CharTokenizer()
    ours.save_pretrained(str(tmp_path / "ours"))
    written = sorted(os.listdir(tmp_path / "ours"))
    assert written == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    theirs_folder = str(tmp_path / "theirs")
    raw = Tokenizer.from_file(str(tmp_path / "ours" / "tokenizer.json"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", pad_token="<eos>").save_pretrained(
        theirs_folder
    )
    hf, theirs = (transformers.AutoTokenizer.from_pretrained(f) for f in (str(tmp_path / "ours"), theirs_folder))
    text = ours.chars + "=" + ours.chars[::-1]
    ids = ours.encode(text)
    for tok in (hf, theirs):
        assert tok.encode(text, add_special_tokens=False) == ids
        assert (tok.eos_token_id, tok.pad_token_id, tok.all_special_ids, len(tok)) == (0, 0, [0], ours.vocab_size)
        assert tok.decode([*ids, 0, 0], skip_special_tokens=True) == text
    batch = hf(["ab=", "abcd="], padding=True)["input_ids"]
    assert batch == theirs(["ab=", "abcd="], padding=True)["input_ids"] == [[11, 12, 41, 0, 0], [11, 12, 13, 14, 41]]


def test_check_finds_data_the_tokenizer_cannot_encode(tok_folder, tmp_path, capsys):
    """issue 29/30: `grpo check` reads and tokenizes the prompts as the run will; ready: false,
    the failed check naming model.tokenizer, before any run starts. With a tokenizer that covers
    them, ready."""
    data = gsm8k_rows(tmp_path / "g.jsonl")
    args = ["check", "--json", "--set", f"storage.root={tmp_path}/runs", "--set", f"data.source={data}"]
    args += ["--set", "rewards=[{function: math_answer}]"]
    assert main(args) == 4  # ExitCode.NOT_READY
    report = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ready"] is False and not checks["data"]["ok"]
    assert "row 0: the tokenizer cannot encode the prompt (model.tokenizer)" in checks["data"]["detail"]
    assert "model.tokenizer" in checks["data"]["fix"]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("data"))  # nothing prepared

    assert main(args + ["--set", f"model.tokenizer={tok_folder[0]}"]) == 0
    report = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ready"] is True and checks["data"]["train_rows"] + 1 == 12, checks["data"]
    assert checks["tokenizer"]["detail"] == f"hf:{tok_folder[0]}, {len(tok_folder[1])} tokens"

    assert main(args + ["--set", f"model.tokenizer={tmp_path}"]) == 4  # a folder with no tokenizer in it
    report = json.loads(capsys.readouterr().out)
    [tok] = [c for c in report["checks"] if c["name"] == "tokenizer"]
    assert report["ready"] is False and tok["detail"].startswith("model.tokenizer") and "model.tokenizer" in tok["fix"]


def test_encode_error_is_a_data_error_naming_the_row(tmp_path):
    cfg = RunConfig.from_dict({"data": {"source": str(gsm8k_rows(tmp_path / "g.jsonl"))}})
    with pytest.raises(EncodeError, match=r"g.jsonl row 0: the tokenizer cannot encode the prompt \(model.tokenizer\)"):
        dry_run(cfg.data, make_tokenizer(cfg))
