"""Model sources and tokenizers: a Hugging Face model given as a local folder, a gs:// folder (the
GCS emulator) or a Hub id (resolved offline from a Hub cache laid out the way huggingface_hub
writes it), AutoTokenizer with the generation config's stop ids, and model.path in the run
config."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from grpo_core.config.run import RunConfig  # noqa: E402
from grpo_core.errors import ConfigError  # noqa: E402
from grpo_core.nn.hf import load_hf_model  # noqa: E402
from grpo_core.store.root import RunRoot  # noqa: E402
from grpo_core.store.sources import HFTokenizer, model_config, read_config, resolve  # noqa: E402
from tests.hf_models import build_hf_model, hub_cache, run_offline  # noqa: E402


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "tiny-qwen3"
    model, tok = build_hf_model(folder, "qwen3")
    return folder, model, tok


def logits_of(model_or_folder, ids):
    ours = load_hf_model(str(model_or_folder)) if isinstance(model_or_folder, (str, os.PathLike)) else model_or_folder
    return np.asarray(ours(jnp.asarray(ids)))


def test_local_folder_and_its_errors(qwen, tmp_path):
    folder, _, _ = qwen
    assert resolve(str(folder)) == str(folder)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="neither an existing folder"):
        resolve("not a valid id!")


def test_tokenizer_stop_ids_pad_and_chat(qwen):
    folder, _, tok = qwen
    t = HFTokenizer(str(folder))
    ids = tok.convert_tokens_to_ids
    assert t.stop_ids == [ids("<|im_end|>"), ids("<|endoftext|>")]  # generation_config.json's list
    assert t.eos_token_id == ids("<|im_end|>") and t.pad_token_id == ids("<|endoftext|>")
    assert t.bos_id is None and t.encode("ab") == tok.encode("ab", add_special_tokens=False)
    text = t.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert t.encode(text)[0] == ids("<|im_start|>")
    assert t.decode(t.encode(text)) == "user\nhi\nassistant\n"  # specials skipped, as rewards see text


def test_llama_tokenizer_gets_exactly_one_bos(tmp_path):
    from tests.hf_models import save_tokenizer

    tok = save_tokenizer(tmp_path, llama=True)
    t = HFTokenizer(str(tmp_path))
    bos = tok.bos_token_id
    assert t.bos_id == bos
    assert t.encode("ab") == [bos, *tok.encode("ab", add_special_tokens=False)]
    chat = t.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<s>")
    got = t.encode(chat)
    assert got[0] == bos and got.count(bos) == 1  # the template's BOS, not a second one
    assert t.stop_ids == [tok.eos_token_id] and t.pad_token_id == tok.eos_token_id  # no pad: EOS pads


def test_tokenizer_without_eos_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    ).save_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match="no EOS token"):
        HFTokenizer(str(tmp_path))


def test_gcs_folder_is_fetched_once_and_loads_the_same(qwen, gcs_emulator, tmp_path, monkeypatch):
    folder, _, _ = qwen
    monkeypatch.setenv("GRPO_MODEL_CACHE", str(tmp_path / "cache"))
    url = gcs_emulator.url_for("models") + "/tiny-qwen3"
    root = RunRoot(url)
    for name in os.listdir(folder):
        root.put_file(str(folder / name), name)
    small = resolve(url, weights=False)  # what the Prefect process fetches: no weights
    assert os.path.exists(os.path.join(small, "tokenizer.json")) and not os.path.exists(
        os.path.join(small, "model.safetensors")
    )
    local = resolve(url)
    assert local == small and os.path.exists(os.path.join(local, "model.safetensors"))
    ids = np.random.default_rng(0).integers(0, 60, (2, 9))
    np.testing.assert_array_equal(logits_of(local, ids), logits_of(str(folder), ids))

    before = os.stat(os.path.join(local, "model.safetensors")).st_mtime_ns
    resolve(url)  # unchanged at the source: not copied again
    assert os.stat(os.path.join(local, "model.safetensors")).st_mtime_ns == before
    cfg = json.loads((folder / "generation_config.json").read_text())
    root.write_json("generation_config.json", dict(cfg, temperature=0.1))  # changed: copied again
    resolve(url)
    assert json.loads(open(os.path.join(local, "generation_config.json")).read())["temperature"] == 0.1

    with pytest.raises(ConfigError, match="does not exist"):
        resolve(gcs_emulator.url_for("absent-model"))
    not_a_model = RunRoot(gcs_emulator.url_for("not-a-model"))
    not_a_model.write_bytes("README.md", b"hello")
    with pytest.raises(ConfigError, match=r"has no config.json.*README.md"):
        resolve(not_a_model.url)


def test_hub_id_resolves_through_snapshot_download_offline(qwen, tmp_path):
    folder, _, _ = qwen
    snap = hub_cache(tmp_path / "hub", "acme/tiny-qwen3", folder)
    code = (
        "import json, sys; from grpo_core.store.sources import resolve, read_config, load_tokenizer\n"
        "from grpo_core.errors import ConfigError\nfrom grpo_core.store.root import StorageError\n"
        "out = {'folder': resolve('acme/tiny-qwen3'), 'layers': read_config('acme/tiny-qwen3')['num_hidden_layers'],"
        " 'stops': load_tokenizer('acme/tiny-qwen3').stop_ids}\n"
        "try:\n    resolve('acme/absent')\nexcept StorageError as e:\n    out['absent'] = str(e)\n"
        "print(json.dumps(out))"
    )
    out = run_offline(code, tmp_path / "hub")
    assert os.path.realpath(out["folder"]) == os.path.realpath(snap)
    assert out["layers"] == 2 and len(out["stops"]) == 2
    assert "acme/absent" in out["absent"] and "HF_HUB_OFFLINE=1" in out["absent"]


def test_run_config_with_model_path(qwen):
    folder, _, _ = qwen
    cfg = RunConfig.from_dict({"model": {"path": str(folder), "dtype": "bfloat16"}})
    assert cfg.model.preset is None and cfg.model.tokenizer == "auto"
    mc = model_config(cfg)  # the architecture from the checkpoint's config.json
    assert mc.num_hidden_layers == 2 and mc.qk_norm and mc.head_dim == 16 and mc.dtype.value == "bfloat16"
    assert cfg.tokenizer_id == f"hf:{folder}" and cfg.name.startswith("tiny-qwen3-")
    with pytest.raises(ConfigError, match="model.hidden_size: set by the checkpoint"):
        RunConfig.from_dict({"model": {"path": str(folder), "hidden_size": 32}})
    with pytest.raises(ConfigError, match="model.path .* does not exist"):  # config is data: read where resolved
        model_config(RunConfig.from_dict({"model": {"path": str(folder) + "-missing"}}))
    with pytest.raises(ConfigError, match="model.revision applies"):
        RunConfig.from_dict({"model": {"revision": "main"}})
    assert read_config(str(folder))["model_type"] == "qwen3"

    from flows.params import RunParams

    # The UI form sends every model field (preset and an empty tokenizer too): same run, same hashes.
    via_form = RunParams.model_validate({"model": {"path": str(folder), "dtype": "bfloat16"}}).to_config()
    assert via_form.model == cfg.model and via_form.train_hash == cfg.train_hash
    assert RunParams().to_config().train_hash == RunConfig.from_dict({}).train_hash
