"""Named model sizes. `tiny` is for tests and the demo; the others carry real models' dimensions
(from their Hugging Face config.json) so that loading their weights maps one to one."""

from __future__ import annotations

from grpo_core.config.model import ModelConfig
from grpo_core.errors import ConfigError

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, ModelConfig] = {
    # Qwen3-shaped, small enough that a GRPO step takes a fraction of a second on 2 CPU cores.
    "tiny": ModelConfig(
        vocab_size=384,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        qk_norm=True,
        rope_theta=10_000.0,
        max_position_embeddings=4096,
    ),
    # The benchmark's "small" workload.
    "small": ModelConfig(
        vocab_size=384,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1408,
        qk_norm=True,
        rope_theta=10_000.0,
        max_position_embeddings=4096,
    ),
    "qwen3-0.6b": ModelConfig(
        vocab_size=151936,
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        qk_norm=True,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    "qwen3-1.7b": ModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=6144,
        qk_norm=True,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    "qwen3-4b": ModelConfig(
        vocab_size=151936,
        hidden_size=2560,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=9728,
        qk_norm=True,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=4864,
        attention_bias=True,
        rope_theta=1_000_000.0,
        max_position_embeddings=32768,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    "qwen2.5-1.5b": ModelConfig(
        vocab_size=151936,
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=8960,
        attention_bias=True,
        rope_theta=1_000_000.0,
        max_position_embeddings=32768,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131072,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """A preset by name, with fields replaced (e.g. `vocab_size` to fit a tokenizer)."""
    if name not in PRESETS:
        raise ConfigError(f"model.preset must be one of {sorted(PRESETS)}; got {name!r}")
    return PRESETS[name].replace(**overrides)
