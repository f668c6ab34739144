"""Hugging Face checkpoints in: tiny random Qwen2, Qwen3 and Llama models built and saved with
transformers (PyTorch on CPU), loaded here; logits and greedy generations must match."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from grpo_core.config.train import SamplingConfig  # noqa: E402
from grpo_core.errors import ConfigError  # noqa: E402
from grpo_core.nn.hf import load_hf_model  # noqa: E402
from grpo_core.rl.sampler import SamplerOptions, generate, pad_prompts, step_key  # noqa: E402
from tests.hf_models import LLAMA3_ROPE  # noqa: E402

V = 96
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
ARCHS = {
    "llama-rope-scaling": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": LLAMA3_ROPE}),
    "qwen2-bias-tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3-qknorm-headdim": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
}


def build(tmp_path, arch, max_shard_size=None):
    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**COMMON, **extra)).eval()
    with torch.no_grad():  # random init is near-uniform; spread the weights so logits differ
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path / arch
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.save_pretrained(str(folder), **kw)
    return hf, str(folder)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_and_greedy_generation_match_transformers(tmp_path, arch):
    hf, folder = build(tmp_path, arch)
    ours = load_hf_model(folder)
    ids = np.random.default_rng(0).integers(0, V, (2, 12))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    got = np.asarray(ours(jnp.asarray(ids)))
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4

    n = 10
    with torch.no_grad():
        x = torch.tensor(ids)  # an explicit mask: HF would otherwise mask prompt tokens equal to pad
        want = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )[:, ids.shape[1] :].numpy()
    opts = SamplerOptions.from_config(SamplingConfig(max_new_tokens=n, temperature=0.0, ignore_eos=True), [V - 1], 0)
    ptok, pval = pad_prompts([list(r) for r in ids], SamplingConfig().prompt_buckets, 0)
    graphdef, params = nnx.split(ours)
    c = generate(graphdef, params, ptok, pval, step_key(0, 0), opts, 1)
    np.testing.assert_array_equal(np.asarray(c.tokens), want)


def test_sharded_checkpoint_loads(tmp_path):
    hf, folder = build(tmp_path, "qwen3-qknorm-headdim", max_shard_size="100KB")
    assert json.load(open(f"{folder}/model.safetensors.index.json"))["weight_map"]
    ids = np.arange(8)[None]
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(load_hf_model(folder)(jnp.asarray(ids))), ref, rtol=1e-4, atol=1e-5)


def test_unknown_architecture_and_wrong_shapes_name_the_cause(tmp_path):
    _, folder = build(tmp_path, "llama-rope-scaling")
    cfg = json.load(open(f"{folder}/config.json"))
    json.dump(dict(cfg, model_type="gpt2"), open(f"{folder}/config.json", "w"))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported; supported: qwen2, qwen3, llama"):
        load_hf_model(folder)
    json.dump(dict(cfg, intermediate_size=96), open(f"{folder}/config.json", "w"))
    with pytest.raises(
        ConfigError,
        match=r"parameter model.layers.0.mlp.down_proj.weight: checkpoint has shape "
        r"\(128, 64\), the model expects \(96, 64\)",
    ):
        load_hf_model(folder)
    with pytest.raises(ConfigError, match="has no config.json"):
        load_hf_model(str(tmp_path))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_export_round_trip_loads_in_transformers(tmp_path, arch):
    from grpo_core.nn.hf import save_hf_model

    hf, folder = build(tmp_path, arch)
    out = save_hf_model(load_hf_model(folder), str(tmp_path / "export"))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor(np.random.default_rng(1).integers(0, V, (2, 9)))
    with torch.no_grad():
        np.testing.assert_allclose(back(ids).logits.numpy(), hf(ids).logits.numpy(), rtol=1e-5, atol=1e-6)


def test_export_of_a_preset_model(tmp_path):
    from grpo_core.config.presets import get_preset
    from grpo_core.nn.hf import save_hf_model
    from grpo_core.nn.model import create_model

    ours = create_model(get_preset("tiny", vocab_size=V), 3)
    back = transformers.AutoModelForCausalLM.from_pretrained(save_hf_model(ours, str(tmp_path / "tiny"))).eval()
    ids = np.random.default_rng(2).integers(0, V, (1, 7))
    with torch.no_grad():
        ref = back(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), ref, rtol=1e-4, atol=1e-5)


def test_bfloat16_checkpoint_loads_in_f32_and_in_bf16(tmp_path):
    """Most published checkpoints are bfloat16, which safetensors' numpy reader refuses."""
    hf, folder = build(tmp_path, "qwen2-bias-tied")
    hf = hf.to(torch.bfloat16)
    hf.save_pretrained(folder)
    from safetensors import safe_open

    with safe_open(f"{folder}/model.safetensors", framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    ids = np.random.default_rng(3).integers(0, V, (2, 10))
    with torch.no_grad():
        ref = hf.float()(torch.tensor(ids)).logits.numpy()  # the same bf16 weights, computed in f32
    got = load_hf_model(folder)  # f32 parameters by default
    assert got.model.embed_tokens.embedding.dtype == jnp.float32
    assert np.abs(np.asarray(got(jnp.asarray(ids))) - ref).max() / np.abs(ref).max() < 1e-4
    half = load_hf_model(folder, dtype="bfloat16")
    assert half.model.embed_tokens.embedding.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(half.model.embed_tokens.embedding.astype(jnp.float32)), np.asarray(got.model.embed_tokens.embedding)
    )
