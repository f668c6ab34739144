import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_core.config.model import ModelConfig
from grpo_core.config.presets import PRESETS, get_preset
from grpo_core.errors import ConfigError
from grpo_core.nn.model import apply_rope, create_model, rope_inv_freq
from tests.hf_models import LLAMA3_ROPE

TINY = dict(
    vocab_size=40,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=48,
)


@pytest.mark.parametrize(
    "extra",
    [
        {},  # Qwen3-like
        {"qk_norm": True},
        {"attention_bias": True, "tie_word_embeddings": False},  # Qwen2-like
        {"head_dim": 24},  # head_dim unlike hidden / heads
        {"rope_scaling": LLAMA3_ROPE},
    ],
)
def test_forward_shapes_and_param_count(extra):
    cfg = ModelConfig(**{**TINY, **extra})
    m = create_model(cfg)
    logits = m(jnp.ones((2, 5), jnp.int32))
    assert logits.shape == (2, 5, cfg.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    _, state = nnx.split(m)
    assert sum(x.size for x in jax.tree.leaves(state)) == cfg.num_params()


def test_bf16_model_runs():
    m = create_model(ModelConfig(**TINY, dtype="bfloat16", param_dtype="bfloat16"))
    assert m.model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(m(jnp.ones((1, 4), jnp.int32)))).all()


def test_hf_parameter_names():
    m = create_model(ModelConfig(**TINY, attention_bias=True, qk_norm=True, tie_word_embeddings=False))
    flat = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(m))}
    for name in (
        "model.embed_tokens.embedding",
        "model.layers.self_attn.q_proj.kernel",
        "model.layers.self_attn.q_proj.bias",
        "model.layers.self_attn.k_norm.weight",
        "model.layers.mlp.gate_proj.kernel",
        "model.layers.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.kernel",
    ):
        assert name in flat, name
    # layer parameters are stacked: a leading axis of num_hidden_layers
    assert m.model.layers.self_attn.q_proj.kernel[...].shape == (2, 32, 4 * 16)
    assert m.model.layers.input_layernorm.weight[...].shape == (2, 32)


def test_left_padding_does_not_change_logits():
    m = create_model(ModelConfig(**TINY))
    seq = jnp.array([[5, 6, 7, 8]])
    padded = jnp.array([[0, 0, 5, 6, 7, 8]])
    valid = jnp.array([[False, False, True, True, True, True]])
    np.testing.assert_allclose(m(padded, valid)[:, 2:], m(seq), rtol=1e-5, atol=1e-5)


def test_rope_is_relative():
    # <R(p) q, R(p+k) v> depends on k only.
    inv = rope_inv_freq(ModelConfig(**TINY))
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, 16))
    dot = lambda p: float(jnp.sum(apply_rope(q, jnp.array([[p]]), inv) * apply_rope(k, jnp.array([[p + 3]]), inv)))
    assert dot(0) == pytest.approx(dot(11), rel=1e-4)


def test_presets_have_real_dimensions():
    q = PRESETS["qwen3-0.6b"]
    assert (q.hidden_size, q.num_hidden_layers, q.head_dim, q.qk_norm) == (1024, 28, 128, True)
    assert PRESETS["qwen2.5-0.5b"].attention_bias and not PRESETS["qwen2.5-0.5b"].qk_norm
    assert dict(PRESETS["llama-3.2-1b"].rope_scaling)["rope_type"] == "llama3"
    assert 0.5e9 < PRESETS["qwen3-0.6b"].num_params() < 0.8e9
    assert 1.1e9 < PRESETS["llama-3.2-1b"].num_params() < 1.4e9
    with pytest.raises(ConfigError, match="model.preset must be one of"):
        get_preset("qwen9")


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"num_key_value_heads": 3}, r"multiple of model.num_key_value_heads \(3\)"),
        ({"hidden_size": 0}, "model.hidden_size must be >= 1, got 0"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"dtype": "float8"}, "model.dtype must be one of float32, bfloat16; got 'float8'"),
    ],
)
def test_model_config_errors(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        ModelConfig(**{**TINY, **bad})


@pytest.mark.parametrize("extra", [{}, {"qk_norm": True, "attention_bias": True}])
def test_shared_prefix_forward_equals_full_rows(extra):
    """Each prompt run once for its G completions gives the logits of G full [prompt | completion] rows."""
    m = create_model(ModelConfig(**{**TINY, **extra}), seed=2)
    prompts = jnp.array([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    pvalid = prompts != 0
    g, tc = 3, 4
    comp = jax.random.randint(jax.random.key(0), (2 * g, tc), 1, 40)
    h = m.hidden_states_grouped(prompts, pvalid, comp)
    assert h.shape == (2 * g, 1 + tc, 32)
    full_tokens = jnp.concatenate([jnp.repeat(prompts, g, 0), comp], axis=1)
    full_valid = jnp.concatenate([jnp.repeat(pvalid, g, 0), jnp.ones((2 * g, tc), bool)], axis=1)
    want = m(full_tokens, full_valid)[:, 4:]  # positions Tp-1 .. Tp+Tc-1
    np.testing.assert_allclose(m.logits(h), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lora_targets", [None, ".*(v_proj|up_proj).*"])
def test_fused_projections_change_nothing(monkeypatch, lora_targets):
    """k/v and gate/up as one matmul each (the sampler's forward) give the logits of separate
    projections, with attention biases (Qwen2), and with adapters on one of each pair (those
    pairs stay apart)."""
    from grpo_core.config.model import LoraConfig
    from grpo_core.nn import lora
    from grpo_core.nn.model import fuse_projections

    model = create_model(ModelConfig(**TINY, attention_bias=True), 1)
    if lora_targets:
        lora.apply(model, LoraConfig(rank=2, target_modules=lora_targets), seed=2)
        for lin in (model.model.layers.self_attn.v_proj, model.model.layers.mlp.up_proj):
            lin.lora_b = nnx.LoRAParam(jnp.full(lin.lora_b[...].shape, 0.05, jnp.float32))  # a nonzero update
    tokens = jax.random.randint(jax.random.key(0), (3, 9), 0, TINY["vocab_size"])
    monkeypatch.setenv("GRPO_FUSED_PROJECTIONS", "1")  # the default only on a GPU
    fused = model(tokens)
    assert set(fuse_projections(model.model.layers)) == (set() if lora_targets else {"kv", "kv_bias", "gate_up"})
    monkeypatch.setenv("GRPO_FUSED_PROJECTIONS", "0")
    assert fuse_projections(model.model.layers) == {}
    np.testing.assert_allclose(fused, model(tokens), atol=2e-5, rtol=1e-5)
