"""A Qwen/Llama-style decoder-only transformer in Flax NNX.

Module and parameter names follow Hugging Face (`model.layers[i].self_attn.q_proj`, ...) so a
HF checkpoint maps onto it one to one. Covers Qwen2 (attention bias), Qwen3 (per-head q/k
RMSNorm), Llama 3 (rope scaling), tied or untied embeddings and a head_dim independent of
hidden_size / num_heads.

Shapes: B batch, T query length, S key length (cache slots), H query heads, K kv heads,
G = H // K query heads per kv head, D head_dim, E hidden, V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_core.config import DType, ModelConfig

# A KV cache: one (k, v) pair per layer, each (B, S, K, D).
KVCache = tuple[tuple[jax.Array, jax.Array], ...]

_NEG_INF = -1e30  # finite: a fully masked row (left padding) must not produce NaN


def _dtype(d: DType):
    return jnp.float32 if d is DType.FLOAT32 else jnp.bfloat16


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # Normalise in f32 whatever the compute dtype (as HF does), then cast back.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies (D/2,), with Llama 3 scaling when the config asks for it."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if not cfg.rope_scaling:
        return inv
    rs = dict(cfg.rope_scaling)
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return inv
    if kind != "llama3":
        raise NotImplementedError(f"model.rope_scaling rope_type {kind!r} is not supported (llama3 is)")
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    scaled = jnp.where(wavelen > old_ctx / lo, inv / factor, inv)
    mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
    return jnp.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the HF layout). x: (B, T, N, D), positions: (B, T)."""
    ang = positions[..., None].astype(jnp.float32) * inv_freq  # (B, T, D/2)
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _linear(din, dout, bias, cfg, rngs):
    return nnx.Linear(din, dout, use_bias=bias, dtype=_dtype(cfg.dtype), param_dtype=_dtype(cfg.param_dtype),
                      kernel_init=nnx.initializers.normal(0.02), rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = _linear(h, cfg.num_attention_heads * d, cfg.attention_bias, cfg, rngs)
        self.k_proj = _linear(h, cfg.num_key_value_heads * d, cfg.attention_bias, cfg, rngs)
        self.v_proj = _linear(h, cfg.num_key_value_heads * d, cfg.attention_bias, cfg, rngs)
        self.o_proj = _linear(cfg.num_attention_heads * d, h, False, cfg, rngs)
        pd = _dtype(cfg.param_dtype)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, pd) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, pd) if cfg.qk_norm else None
        self.num_heads, self.num_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d

    def __call__(self, x, positions, inv_freq, mask, cache=None, cache_index=None):
        """x: (B, T, E); mask: (B, T, S) True where a query may attend a key.

        Without a cache, keys are this call's own tokens (S == T). With a cache (B, S, K, D),
        this call's k/v are written at slot `cache_index` first and attention runs over all
        S slots; the mask hides the slots not filled yet.
        """
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        if cache is not None:
            ck, cv = cache
            k = jax.lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), cache_index, axis=1)
            v = jax.lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), cache_index, axis=1)
        new_cache = (k, v)
        g = self.num_heads // self.num_kv
        q = q.reshape(b, t, self.num_kv, g, self.head_dim)  # (B, T, K, G, D)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k.astype(q.dtype)).astype(jnp.float32)
        scores = scores / math.sqrt(self.head_dim)
        scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out.astype(x.dtype)), new_cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size, False, cfg, rngs)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, False, cfg, rngs)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, False, cfg, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = _dtype(cfg.param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, inv_freq, mask, cache=None, cache_index=None):
        h, new_cache = self.self_attn(self.input_layernorm(x), positions, inv_freq, mask, cache, cache_index)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_cache


class Decoder(nnx.Module):
    """The transformer trunk (HF: `model.model`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=_dtype(cfg.dtype),
                                      param_dtype=_dtype(cfg.param_dtype),
                                      embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)]) \
            if hasattr(nnx, "List") else [DecoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, _dtype(cfg.param_dtype))


class CausalLM(nnx.Module):
    """Decoder + LM head. `hidden_states` runs the trunk; `logits` applies the head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Decoder(cfg, rngs)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, False, cfg, rngs)

    def hidden_states(self, tokens, positions, mask, cache: KVCache | None = None, cache_index=None):
        """tokens, positions: (B, T); mask: (B, T, S). Returns ((B, T, E), new cache)."""
        inv_freq = rope_inv_freq(self.config)
        x = self.model.embed_tokens(tokens)
        new_cache = []
        for i, layer in enumerate(self.model.layers):
            x, c = layer(x, positions, inv_freq, mask, None if cache is None else cache[i], cache_index)
            new_cache.append(c)
        return self.model.norm(x), tuple(new_cache)

    def logits(self, h: jax.Array) -> jax.Array:
        """(B, T, E) -> (B, T, V) in f32: log-probs and sampling need the precision."""
        if self.lm_head is None:
            return self.model.embed_tokens.attend(h).astype(jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    def __call__(self, tokens, valid=None):
        """Full causal forward over (B, T) tokens; `valid` (B, T) marks non-padding. -> (B, T, V)."""
        positions, mask = causal_inputs(valid if valid is not None else jnp.ones(tokens.shape, bool))
        h, _ = self.hidden_states(tokens, positions, mask)
        return self.logits(h)


def causal_inputs(valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Positions and the causal + padding mask for left-padded rows. valid: (B, T) bool.

    Position ids count only real tokens, so a left-padded prompt starts at position 0 as it
    would unpadded. Padding queries get an all-False row except themselves (no NaN).
    """
    t = valid.shape[1]
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    causal = jnp.tril(jnp.ones((t, t), bool))
    mask = causal[None] & valid[:, None, :]
    mask = mask | jnp.eye(t, dtype=bool)[None]
    return positions, mask


def init_kv_cache(cfg: ModelConfig, batch: int, slots: int) -> KVCache:
    shape = (batch, slots, cfg.num_key_value_heads, cfg.head_dim)
    dt = _dtype(cfg.dtype)
    return tuple((jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(cfg.num_hidden_layers))


def create_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    return CausalLM(cfg, rngs=nnx.Rngs(seed))
