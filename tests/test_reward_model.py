"""Reward models in JAX: tiny random Qwen2, Qwen3 and Llama *ForSequenceClassification built and
saved with transformers (PyTorch on CPU), loaded into the project's decoder with its score head;
the scores of texts of several lengths, batched and padded, must be transformers' within 1e-4."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from grpo_core.errors import ConfigError  # noqa: E402
from grpo_core.nn.reward_model import Scorer, buckets, load_classifier, pool_positions  # noqa: E402
from grpo_core.stages.reward_parity import transformers_scores  # noqa: E402
from tests.hf_models import LLAMA3_ROPE, build_hf_classifier  # noqa: E402

ARCHS = {"qwen2": None, "qwen3": {"head_dim": 24}, "llama": {"rope_scaling": LLAMA3_ROPE}}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_scores_match_transformers(tmp_path, arch):
    """Rows of 3-70 tokens in batches of 4 (two length buckets, a last batch padded with empty
    rows), one ending in pad-id tokens (scored before them, as transformers pools)."""
    sharded = arch == "qwen2"  # a sharded checkpoint (an index and several files) on one of them
    hf, tok = build_hf_classifier(tmp_path / arch, arch, max_shard_size="60KB" if sharded else None, extra=ARCHS[arch])
    if sharded:
        assert (tmp_path / arch / "model.safetensors.index.json").exists()
    pad = hf.config.pad_token_id
    rng = np.random.default_rng(0)
    vocab = len(tok)
    rows = [list(rng.integers(5, vocab, n)) for n in (3, 17, 40, 70, 9, 33, 64)]
    rows[2] = rows[2] + [pad, pad]  # transformers scores the last token that is not the pad id
    want = transformers_scores(hf, rows, pad)
    model = load_classifier(str(tmp_path / arch), "float32")
    scorer = Scorer(model, batch_size=4, max_length=128, pad_id=pad, pool_pad_id=pad, placement=None)
    got = scorer(rows)
    assert got.shape == (len(rows),) and np.std(want) > 0.05  # scores that differ between texts
    assert np.abs(got - want).max() < 1e-4, (got, want)


def test_pooling_and_buckets():
    tokens = np.array([[0, 0, 5, 6], [0, 7, 0, 0], [0, 0, 0, 0]])
    valid = np.array([[False, False, True, True], [False, True, True, True], [False, False, False, True]])
    assert pool_positions(tokens, valid, 0).tolist() == [3, 1, 3]  # the last non-pad token; pad ids only: last
    assert pool_positions(tokens, valid, None).tolist() == [3, 3, 3]
    assert buckets(1024) == (64, 128, 256, 512, 1024) and buckets(100) == (64, 100) and buckets(8) == (8,)


def test_bfloat16_loads_and_scores_close(tmp_path):
    hf, tok = build_hf_classifier(tmp_path / "rm", "qwen3")
    rows = [[5, 6, 7, 8, 9], [10, 11, 12]]
    want = transformers_scores(hf, rows, hf.config.pad_token_id)
    model = load_classifier(str(tmp_path / "rm"), "bfloat16")
    assert model.score.kernel[...].dtype.name == "bfloat16"
    got = Scorer(model, 2, 64, hf.config.pad_token_id, hf.config.pad_token_id, None)(rows)
    assert np.abs(got - want).max() < 0.05 * max(1.0, np.abs(want).max())


def test_not_a_one_label_classifier_is_named(tmp_path):
    _, tok = build_hf_classifier(tmp_path / "rm", "llama")
    cfg = json.loads((tmp_path / "rm" / "config.json").read_text())
    for change, message in [
        ({"architectures": ["LlamaForCausalLM"]}, r"not a sequence classifier.*LlamaForSequenceClassification"),
        ({"id2label": {"0": "A", "1": "B"}}, r"has 2 labels; a reward model scores with one"),
    ]:
        (tmp_path / "rm" / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ConfigError, match=message):
            load_classifier(str(tmp_path / "rm"), "float32", where="rewards[0].model")


def test_grpo_tiny_model_writes_a_reward_model_transformers_and_grpo_check_score_alike(tmp_path, capsys):
    """`grpo tiny-model --reward-model`: a Qwen2ForSequenceClassification folder (numpy only) that
    transformers loads; grpo check's comparison (grpo_core.stages.reward_parity) finds the scores
    of its texts equal, and says so without PyTorch."""
    from flows.cli import main
    from grpo_core.stages import reward_parity

    folder = tmp_path / "tiny-rm"
    assert main(["tiny-model", str(folder), "--arch", "qwen2", "--reward-model"]) == 0
    assert f"rewards=[{{model: {folder}}}]" in capsys.readouterr().out
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    assert type(hf).__name__ == "Qwen2ForSequenceClassification" and hf.config.num_labels == 1
    got = reward_parity.compare(str(folder), "rewards[0].model")
    assert got["torch"] and got["ok"] and got["max_abs_diff"] < 1e-4 and len(set(got["tokens"])) == 4
    assert np.std(got["transformers"]) > 0.05  # texts score differently
