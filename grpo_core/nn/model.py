"""A Qwen/Llama-style decoder-only transformer in Flax NNX.

Module and parameter names follow Hugging Face (`model.layers.self_attn.q_proj`, ...) so a
HF checkpoint maps onto it one to one; the layers are stored stacked (a leading axis of
num_hidden_layers on every layer parameter) and applied with `lax.scan`, so XLA compiles one
layer body instead of num_hidden_layers copies of it (a cold first step compiles ~3x faster).
Covers Qwen2 (attention bias), Qwen3 (per-head q/k RMSNorm), Llama 3 (rope scaling),
tied or untied embeddings and a head_dim independent of hidden_size / num_heads.

Shapes: B batch, T query length, S key length (cache slots), H query heads, K kv heads,
G = H // K query heads per kv head, D head_dim, E hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_core.config import switches
from grpo_core.config.model import DType, ModelConfig
from grpo_core.config.train import RematPolicy
from grpo_core.runtime.mesh import BATCH, KV_CACHE_AXES, constrain

# A KV cache: (k, v), each (L, B, K, S, D) for L layers.
KVCache = tuple[jax.Array, jax.Array]


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


class Linear(nnx.Linear):
    """nnx.Linear with an optional low-rank update y = x W + b + s (x A) B (grpo_core.nn.lora sets
    A (in, r), B (r, out) and s = alpha / rank). Without adapters it is nnx.Linear exactly."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lora_a = nnx.data(None)
        self.lora_b = nnx.data(None)
        self.lora_scale = 0.0

    def __call__(self, x: jax.Array) -> jax.Array:
        y = super().__call__(x)
        if self.lora_a is None:
            return y
        a, b = self.lora_a[...].astype(y.dtype), self.lora_b[...].astype(y.dtype)
        return y + self.lora_scale * ((x.astype(y.dtype) @ a) @ b)  # (N, in) @ (in, r) @ (r, out)


def _linear(din, dout, bias, cfg, rngs):
    return Linear(
        din,
        dout,
        use_bias=bias,
        dtype=_dtype(cfg.dtype),
        param_dtype=_dtype(cfg.param_dtype),
        kernel_init=nnx.initializers.normal(0.02),
        rngs=rngs,
    )


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

    def _qkv(self, xf, shapes, positions, inv_freq, fused=None):
        """Project flat tokens (sum of b*t, E) once, then split them into the (b, t) blocks given.

        2-D operands: XLA:CPU's backward dots run ~2x faster than with (B, T, E) inputs.
        `fused`: this layer's k and v projections as one weight (see `fuse_projections`).
        """
        q = self.q_proj(xf)
        if fused is None or "kv" not in fused:
            k, v = self.k_proj(xf), self.v_proj(xf)
        else:
            k, v = _fused_matmul(xf, fused["kv"], fused.get("kv_bias"), self.k_proj.dtype)
        out, start = [], 0
        for (b, t), pos in zip(shapes, positions):
            sl = slice(start, start + b * t)
            start += b * t
            qi = q[sl].reshape(b, t, self.num_heads, self.head_dim)
            ki = k[sl].reshape(b, t, self.num_kv, self.head_dim)
            vi = v[sl].reshape(b, t, self.num_kv, self.head_dim)
            if self.q_norm is not None:
                qi, ki = self.q_norm(qi), self.k_norm(ki)
            out.append((apply_rope(qi, pos, inv_freq), apply_rope(ki, pos, inv_freq), vi))
        return out

    def _attend(self, q, k, v, mask):
        """q: (B, T, H, D), k/v: (B, S, K, D), mask: (B, T, S) -> (B*T, H*D). See `attend`."""
        b, t = q.shape[:2]
        return attend(q, k, v, mask).reshape(b * t, self.num_heads * self.head_dim)

    def __call__(self, x, positions, inv_freq, mask, cache=None, cache_index=None, layer=None, fused=None):
        """x: (B, T, E); mask: (B, T, S) True where a query may attend a key.

        Without a cache, keys are this call's own tokens (S == T), and with the cache filled from
        slot 0 (a prefill), too: the slots after them are empty. With the stacked cache
        (L, B, K, S, D), this call's k/v are written into layer `layer` at slot `cache_index`
        first and attention runs over all S slots; the mask hides the slots not filled yet.
        """
        b, t, e = x.shape
        [(q, k, v)] = self._qkv(x.reshape(b * t, e), [(b, t)], [positions], inv_freq, fused)
        if cache is not None:  # (L, B, K, S, D): this call's (B, T, K, D) go in as (B, K, T, D)
            ck, cv = cache
            at = (layer, 0, 0, cache_index, 0)
            ck = jax.lax.dynamic_update_slice(ck, jnp.swapaxes(k, 1, 2)[None].astype(ck.dtype), at)
            cv = jax.lax.dynamic_update_slice(cv, jnp.swapaxes(v, 1, 2)[None].astype(cv.dtype), at)
            cache = (ck, cv)
            if isinstance(cache_index, int) and cache_index == 0:  # a prefill: its own keys are all there are
                mask = mask[:, :, :t]
            else:
                k, v = jnp.swapaxes(ck[layer], 1, 2), jnp.swapaxes(cv[layer], 1, 2)
        out = self._attend(q, k, v, mask)
        return self.o_proj(out.astype(x.dtype)).reshape(b, t, e), cache

    def decode(self, x, positions, inv_freq, key_valid, cache, layer, slot=None, fused=None, span=None):
        """One new token per row: x (B, 1, E), key_valid (B, S). With `slot` None, `cache` is the
        stacked (L, B, K, S, D) cache, of which layer `layer` is only read: `key_valid` marks the
        slots filled before this token, which attends to them and to its own key and value,
        returned (B, K, 1, D) for the caller to write once for every layer after a loop over them
        (a write inside the loop made XLA copy the whole stacked cache per layer). With `slot`,
        `cache` is this layer's own (B, K, S, D) buffers (straight code, sampler.prefill makes
        them): the token's key and value are written there first, in place, and read back with
        the rest; `key_valid` includes the slot, and the updated buffers are returned. `span`:
        only the first `span` slots are read (the ones a phase of the decode loop can have filled,
        see sampler.decode)."""
        b, _, e = x.shape
        if span is not None:
            key_valid = key_valid[:, :span]
        [(q, k, v)] = self._qkv(x.reshape(b, e), [(b, 1)], [positions], inv_freq, fused)
        ck, cv = cache
        k, v = jnp.swapaxes(k, 1, 2).astype(ck.dtype), jnp.swapaxes(v, 1, 2).astype(cv.dtype)  # (B, K, 1, D)
        if slot is None:
            cut = lambda c: c[layer] if span is None else jax.lax.dynamic_slice_in_dim(c, layer, 1)[0, :, :, :span]
            out, new = attend_decode(q, cut(ck), cut(cv), key_valid, k, v), (k, v)
        else:
            ck = jax.lax.dynamic_update_slice(ck, k, (0, 0, slot, 0))
            cv = jax.lax.dynamic_update_slice(cv, v, (0, 0, slot, 0))
            cut = lambda c: c if span is None else c[:, :, :span]
            out, new = attend_decode(q, cut(ck), cut(cv), key_valid), (ck, cv)
        return self.o_proj(out.reshape(b, -1).astype(x.dtype)).reshape(b, 1, e), new

    def grouped(self, xf, prefix: "GroupedInputs", inv_freq):
        """Shared-prefix attention over flat tokens [P*Tp prompt tokens | B*Tc completion tokens].

        Prompt tokens attend causally among themselves; each completion token attends to its
        group's prompt (keys repeated G times, so gradients sum over the group) and causally to
        its own earlier completion tokens.
        """
        (qp, kp, vp), (qc, kc, vc) = self._qkv(xf, prefix.shapes, [prefix.pos_p, prefix.pos_c], inv_freq)
        g = prefix.group_size
        kc = jnp.concatenate([jnp.repeat(kp, g, axis=0), kc], axis=1)  # (B, Tp+Tc, K, D)
        vc = jnp.concatenate([jnp.repeat(vp, g, axis=0), vc], axis=1)
        out = jnp.concatenate([self._attend(qp, kp, vp, prefix.mask_p), self._attend(qc, kc, vc, prefix.mask_c)])
        return self.o_proj(out.astype(xf.dtype))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size, False, cfg, rngs)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, False, cfg, rngs)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, False, cfg, rngs)

    def __call__(self, x, fused=None):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (B*T, E): see Attention on 2-D operands
        if fused is None or "gate_up" not in fused:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = _fused_matmul(x, fused["gate_up"], None, self.gate_proj.dtype)
        return self.down_proj(jax.nn.silu(gate) * up).reshape(shape)  # SwiGLU


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = _dtype(cfg.param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, inv_freq, mask, cache=None, cache_index=None, layer=None, fused=None):
        h, new_cache = self.self_attn(
            self.input_layernorm(x), positions, inv_freq, mask, cache, cache_index, layer, fused
        )
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x), fused)
        return x, new_cache

    def decode(self, x, positions, inv_freq, key_valid, cache, layer, slot=None, fused=None, span=None):
        """One token per row; see Attention.decode. -> (x, the token's (k, v) or the cache)."""
        h, new = self.self_attn.decode(
            self.input_layernorm(x), positions, inv_freq, key_valid, cache, layer, slot, fused, span
        )
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), fused), new

    def grouped(self, xf, prefix: "GroupedInputs", inv_freq):
        """xf: flat (P*Tp + B*Tc, E) tokens; see Attention.grouped."""
        xf = xf + self.self_attn.grouped(self.input_layernorm(xf), prefix, inv_freq)
        return xf + self.mlp(self.post_attention_layernorm(xf))


class Decoder(nnx.Module):
    """The transformer trunk (HF: `model.model`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=_dtype(cfg.dtype),
            param_dtype=_dtype(cfg.param_dtype),
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        # One DecoderLayer whose parameters carry a leading (num_hidden_layers,) axis.
        layers = [DecoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(layer) for layer in layers])
        self.layers = nnx.merge(nnx.graphdef(layers[0]), stacked)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, _dtype(cfg.param_dtype))


class CausalLM(nnx.Module):
    """Decoder + LM head. `hidden_states` runs the trunk; `logits` applies the head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Decoder(cfg, rngs)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, False, cfg, rngs)

    def hidden_states(self, tokens, positions, mask, cache: KVCache | None = None, cache_index=None):
        """tokens, positions: (B, T); mask: (B, T, S). Returns ((B, T, E), new cache). A decode
        step's one token per row goes through `decode_hidden_states`."""
        inv_freq = rope_inv_freq(self.config)
        x = self.model.embed_tokens(tokens)
        fused = fuse_projections(self.model.layers)
        graphdef, stacked = nnx.split(self.model.layers)

        def body(carry, xs):
            x, cache = carry
            state, i, f = xs
            x, cache = nnx.merge(graphdef, state)(x, positions, inv_freq, mask, cache, cache_index, i, f)
            return (x, cache), None

        xs = (stacked, jnp.arange(self.config.num_hidden_layers), fused)
        (x, cache), _ = jax.lax.scan(body, (x, cache), xs)
        return self.model.norm(x), cache

    def layers_apart(self):
        """The stacked layers' weights as one array per layer (and the fused projections, see
        fuse_projections), for `decode_hidden_states(layers=...)`: made once, before a decode loop,
        so that a step's straight-code layers read their own weights. A layer sliced out of the
        stacked arrays inside the loop is copied before its matmuls on a GPU and on CPU (XLA:TPU
        reads the slice inside the matmul's fusion), three times the weights' bytes a token."""
        graphdef, stacked = nnx.split(self.model.layers)
        fused = fuse_projections(self.model.layers)
        n = self.config.num_hidden_layers
        pick = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
        return graphdef, [pick(stacked, i) for i in range(n)], [pick(fused, i) for i in range(n)]

    def decode_hidden_states(self, tokens, positions, key_valid, cache: KVCache, slot, layers=None, span=None):
        """One decode step: tokens, positions (B, 1); key_valid (B, S) the cache slots filled
        before; the tokens' keys and values are written at `slot` of every layer at once, after
        the layers, which only read the cache: XLA updates the donated cache in place with no copy
        of it per layer. `layers`: `layers_apart()`, made outside the decode loop, for the layers
        as straight code, each writing its own buffers first: `cache` is then a (B, K, S, D)
        buffer per layer, ((k_0, .., k_L-1), (v_0, .., v_L-1)), as sampler.prefill makes it for
        them; else a loop over the stacked layers. `span`: the slots read (all: None); `slot` must
        be below it. -> ((B, 1, E), cache)."""
        inv_freq = rope_inv_freq(self.config)
        x = self.model.embed_tokens(tokens)
        if layers is not None:  # straight code over weights and cache laid out per layer (see layers_apart)
            graphdef, states, fused = layers
            valid = jax.lax.dynamic_update_slice_in_dim(key_valid, jnp.ones((x.shape[0], 1), bool), slot, 1)
            out = []
            for state, f, c in zip(states, fused, zip(*cache)):
                x, c = nnx.merge(graphdef, state).decode(x, positions, inv_freq, valid, c, None, slot, f, span)
                out.append(c)
            return self.model.norm(x), tuple(zip(*out))
        fused = fuse_projections(self.model.layers)
        graphdef, stacked = nnx.split(self.model.layers)

        def body(x, xs):
            state, i, f = xs
            return nnx.merge(graphdef, state).decode(x, positions, inv_freq, key_valid, cache, i, None, f, span)

        xs = (stacked, jnp.arange(self.config.num_hidden_layers), fused)
        x, (k, v) = jax.lax.scan(body, x, xs)  # k, v: (L, B, K, 1, D)
        ck, cv = cache
        at = (0, 0, 0, slot, 0)
        return self.model.norm(x), (jax.lax.dynamic_update_slice(ck, k, at), jax.lax.dynamic_update_slice(cv, v, at))

    def hidden_states_grouped(
        self, prompt_tokens, prompt_valid, completion_tokens, remat: RematPolicy = RematPolicy.NONE, mesh=None
    ):
        """Prompts run once per group of G completions, not G times.

        prompt_tokens/valid: (P, Tp) left-padded; completion_tokens: (B = P*G, Tc), rows
        i*G .. i*G+G-1 following prompt i. Returns (B, 1 + Tc, E): the hidden states at the last
        prompt position and at each completion token, i.e. those predicting completion tokens
        0 .. Tc. Equal to a full forward over [prompt | completion] rows, at (Tp*P + Tc*B) tokens
        of compute instead of (Tp + Tc)*B. `remat`: what each layer keeps for the backward pass
        (RematPolicy); the rest is recomputed there, one layer at a time. `mesh`: the learner's
        mesh; each layer's input, the tokens' hidden states, is laid out over its rows (data x
        fsdp). Left to itself, XLA's sharding propagation splits them only partly (about 4 ways
        on 4, 8 or 16 TPU chips) and holds 2.5-6x the activations a chip needs (bench.aot).
        """
        prefix = GroupedInputs.build(prompt_valid, completion_tokens.shape)
        (p, tp), (b, tc) = prefix.shapes
        inv_freq = rope_inv_freq(self.config)
        x = self.model.embed_tokens(jnp.concatenate([prompt_tokens.reshape(-1), completion_tokens.reshape(-1)]))
        graphdef, stacked = nnx.split(self.model.layers)

        def layer(x, state):
            if mesh is not None:
                x = constrain(x, (BATCH, None), mesh)  # (tokens, E): tokens over the rows' axes
            return nnx.merge(graphdef, state).grouped(x, prefix, inv_freq), None

        x, _ = jax.lax.scan(_remat(layer, remat), x, stacked)
        x = self.model.norm(x)
        last_prompt = x[: p * tp].reshape(p, tp, -1)[:, -1:]  # left padding: every prompt ends at Tp-1
        return jnp.concatenate(
            [jnp.repeat(last_prompt, prefix.group_size, axis=0), x[p * tp :].reshape(b, tc, -1)], axis=1
        )

    def head(self) -> tuple[jax.Array, bool]:
        """The LM head's weight and whether it is vocabulary-major: the tied embedding (V, E), or
        lm_head's kernel (E, V). Never LoRA-adapted (grpo_core.nn.lora)."""
        if self.lm_head is None:
            return self.model.embed_tokens.embedding[...], True
        return self.lm_head.kernel[...], False

    def logits(self, h: jax.Array) -> jax.Array:
        """(B, T, E) -> (B, T, V) f32, the matmul in the compute dtype with f32 accumulation (the
        learner's chunked log-probs compute the very same numbers). For a few positions only (the
        sampler's): a whole sequence's logits at a real vocabulary are the learner's memory wall."""
        w, vocab_major = self.head()
        return head_logits(h, w, vocab_major, _dtype(self.config.dtype))

    def __call__(self, tokens, valid=None):
        """Full causal forward over (B, T) tokens; `valid` (B, T) marks non-padding. -> (B, T, V)."""
        positions, mask = causal_inputs(valid if valid is not None else jnp.ones(tokens.shape, bool))
        h, _ = self.hidden_states(tokens, positions, mask)
        return self.logits(h)


def fuse_projections(layers: "DecoderLayer") -> dict[str, jax.Array]:
    """The stacked layers' k and v projections as one weight (L, E, 2, K*D) (and their biases
    (L, 2, K*D)), and gate and up as one (L, E, 2, I): one matmul each instead of two, built once
    per call outside the layer loop (in a decode loop XLA hoists it out: the weights do not
    change there). For the sampler's small per-token matmuls, where launches cost more than
    FLOPs; the learner keeps them apart (its matmuls are large, and the copy and its gradient
    would add to its peak). Stacked on a new axis, not concatenated, so a projection split over
    the mesh's tensor axis stays split the same way. Projections with LoRA adapters stay apart.
    On a GPU only by default (GRPO_FUSED_PROJECTIONS=0|1 overrides): on CPU the copy raised the
    `small` benchmark's peak RSS by 4 % for no speed, and a TPU's HBM is the tighter budget."""
    want = switches.on_off("GRPO_FUSED_PROJECTIONS")
    if not (jax.default_backend() == "gpu" if want is None else want):
        return {}
    a, m = layers.self_attn, layers.mlp
    out: dict[str, jax.Array] = {}
    if a.k_proj.lora_a is None and a.v_proj.lora_a is None:
        out["kv"] = jnp.stack([a.k_proj.kernel[...], a.v_proj.kernel[...]], axis=2)
        if a.k_proj.bias is not None:
            out["kv_bias"] = jnp.stack([a.k_proj.bias[...], a.v_proj.bias[...]], axis=1)
    if m.gate_proj.lora_a is None and m.up_proj.lora_a is None:
        out["gate_up"] = jnp.stack([m.gate_proj.kernel[...], m.up_proj.kernel[...]], axis=2)
    return out


def _fused_matmul(x, w, bias, dtype) -> tuple[jax.Array, jax.Array]:
    """x (N, E) @ w (E, 2, O) (+ bias (2, O)) in `dtype`, as nnx.Linear computes each -> two (N, O)."""
    e, _, o = w.shape
    y = (x.astype(dtype) @ w.astype(dtype).reshape(e, 2 * o)).reshape(x.shape[0], 2, o)
    if bias is not None:
        y = y + bias.astype(dtype)
    return y[:, 0], y[:, 1]


def _remat(layer, policy: RematPolicy):
    """The scanned layer body under a rematerialisation policy: NONE keeps every intermediate for
    the backward pass; DOTS keeps the outputs of the weight matmuls (the 2-D projections, not the
    attention einsums) and recomputes the rest; FULL keeps only each layer's input. prevent_cse
    is off as a scan body needs (the loop already stops XLA from merging the recomputation)."""
    if policy is RematPolicy.NONE:
        return layer
    saveable = (
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        if policy is RematPolicy.DOTS
        else jax.checkpoint_policies.nothing_saveable
    )
    return jax.checkpoint(layer, policy=saveable, prevent_cse=False)


_fallen_back: set[str] = set()


def attention_impl(t: int, dtype) -> str:
    """Which `jax.nn.dot_product_attention` implementation runs a T-query attention in `dtype`:
    GRPO_ATTENTION (auto, xla, cudnn; default auto). auto: cuDNN's fused flash attention on a GPU
    for bf16/f16 blocks of several queries (prefill, the learner), XLA's otherwise (one decode
    query, f32, CPU, TPU)."""
    want = switches.attention()
    if want != "auto":
        return want
    low = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if t > 1 and low and jax.default_backend() == "gpu" else "xla"


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Scaled dot-product attention: q (B, T, H, D), k/v (B, S, K, D) with H a multiple of K (GQA:
    K/V are never repeated), mask (B, T, S) True where a query may attend a key -> (B, T, H, D) in
    q's dtype. Scores and softmax in f32 on every implementation. Through
    `jax.nn.dot_product_attention` (see `attention_impl`): where cuDNN cannot take the shape or
    dtype, XLA's runs instead, and the log says so once."""
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    impl = attention_impl(q.shape[1], q.dtype)
    if impl == "cudnn":
        try:
            return _cudnn_attend(q, k, v, mask)
        except (ValueError, NotImplementedError, RuntimeError, TypeError) as e:
            if switches.attention() == "cudnn":
                raise
            why = str(e).splitlines()[0][:200]
            if why not in _fallen_back:
                _fallen_back.add(why)
                logging.getLogger(__name__).warning("cuDNN attention unavailable here (%s): XLA's runs", why)
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")


def attend_decode(q, ck, cv, key_valid, k=None, v=None) -> jax.Array:
    """One query per row over a cache and the query's own key: q (B, 1, H, D); ck/cv (B, K, S, D)
    with key_valid (B, S); k/v (B, K, 1, D), always attended (None: the cache holds them) ->
    (B, 1, H, D) in q's dtype. As
    `attend` computes it (scores, softmax and the weighted sum in f32, GQA without repeating K/V),
    the cache's and the own key's scores one softmax; the cache's layout (heads before slots) is
    the one its matmuls read without a transpose."""
    b, _, h, d = q.shape
    kv = ck.shape[1]
    qg = q.reshape(b, kv, h // kv, d).astype(ck.dtype)  # (B, K, G, D): query heads by kv head
    scale = 1.0 / math.sqrt(d)
    f32 = jnp.float32
    s_cache = jnp.einsum("bkgd,bksd->bkgs", qg, ck, preferred_element_type=f32) * scale
    s_cache = jnp.where(key_valid[:, None, None, :], s_cache, jnp.finfo(f32).min)
    top = jnp.max(s_cache, axis=-1, keepdims=True)
    if k is not None:
        s_self = jnp.einsum("bkgd,bkd->bkg", qg, k[:, :, 0], preferred_element_type=f32)[..., None] * scale
        top = jnp.maximum(top, s_self)
    p_cache = jnp.exp(s_cache - top)
    total = jnp.sum(p_cache, axis=-1, keepdims=True)
    out = jnp.einsum("bkgs,bksd->bkgd", p_cache.astype(cv.dtype), cv, preferred_element_type=f32)
    if k is not None:
        p_self = jnp.exp(s_self - top)
        total = total + p_self
        out = out + p_self * v[:, :, 0, None, :].astype(f32)
    return (out / total).reshape(b, 1, h, d).astype(q.dtype)


def _cudnn_attend(q, k, v, mask):
    """cuDNN's flash attention, whose backward takes a mask only for even query and key lengths:
    odd ones get one more query (attending key 0; its output dropped, so it adds no gradient) or
    one more key (attended by no query)."""
    t, s = q.shape[1], k.shape[1]
    pt, ps = t % 2, s % 2
    if pt or ps:
        q = jnp.pad(q, ((0, 0), (0, pt), (0, 0), (0, 0)))
        k, v = (jnp.pad(x, ((0, 0), (0, ps), (0, 0), (0, 0))) for x in (k, v))
        mask = jnp.pad(mask, ((0, 0), (0, pt), (0, ps)))
        if pt:
            mask = mask.at[:, t, 0].set(True)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="cudnn")
    return out[:, :t]


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


@dataclasses.dataclass(frozen=True)
class GroupedInputs:
    """Positions and masks of a shared-prefix batch (see CausalLM.hidden_states_grouped)."""

    shapes: tuple[tuple[int, int], tuple[int, int]]  # ((P, Tp), (B, Tc))
    group_size: int
    pos_p: jax.Array  # (P, Tp)
    pos_c: jax.Array  # (B, Tc)
    mask_p: jax.Array  # (P, Tp, Tp)
    mask_c: jax.Array  # (B, Tc, Tp + Tc)

    @classmethod
    def build(cls, prompt_valid, completion_shape) -> "GroupedInputs":
        (p, tp), (b, tc) = prompt_valid.shape, completion_shape
        g = b // p
        pos_p, mask_p = causal_inputs(prompt_valid)
        pos_c = jnp.repeat(jnp.sum(prompt_valid, axis=1), g)[:, None] + jnp.arange(tc)[None, :]
        see_prompt = jnp.broadcast_to(jnp.repeat(prompt_valid, g, axis=0)[:, None, :], (b, tc, tp))
        see_self = jnp.broadcast_to(jnp.tril(jnp.ones((tc, tc), bool))[None], (b, tc, tc))
        return cls(((p, tp), (b, tc)), g, pos_p, pos_c, mask_p, jnp.concatenate([see_prompt, see_self], axis=-1))


def init_kv_cache(cfg: ModelConfig, batch: int, slots: int, mesh=None) -> KVCache:
    """Zeros (L, B, K, S, D); inside a jitted function with a `mesh`, laid out over it as
    KV_CACHE_AXES says (rows over data x fsdp, kv heads over tensor). Heads before slots: a
    decode step's two matmuls read a layer's (B, K, S, D) as they are, batched over (B, K)."""
    shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, slots, cfg.head_dim)
    dt = _dtype(cfg.dtype)
    cache = jnp.zeros(shape, dt), jnp.zeros(shape, dt)
    return cache if mesh is None else constrain_kv_cache(cache, mesh)


def constrain_kv_cache(cache: KVCache, mesh) -> KVCache:
    """The stacked cache, or one buffer per layer (B, K, S, D) as decode's straight code reads it."""
    return jax.tree.map(lambda c: constrain(c, KV_CACHE_AXES[len(KV_CACHE_AXES) - c.ndim :], mesh), cache)


def head_logits(h: jax.Array, w: jax.Array, vocab_major: bool, dtype) -> jax.Array:
    """(..., E) @ W in `dtype` with f32 accumulation -> (..., V) f32: the LM head, here and in the
    learner's chunked log-probs (grpo_core.rl.logprobs), which compute the very same numbers."""
    dims = (((h.ndim - 1,), (1 if vocab_major else 0,)), ((), ()))
    return jax.lax.dot_general(h.astype(dtype), w.astype(dtype), dims, preferred_element_type=jnp.float32)


def create_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    return CausalLM(cfg, rngs=nnx.Rngs(seed))
