"""LoRA: low-rank adapters on the decoder's linears; only the adapters train.

A targeted linear computes `x W + b + (alpha / rank) (x A) B` (model.Linear), with A (in, r)
drawn uniform in ±1/sqrt(in) and B (r, out) zero, so a fresh adapter changes nothing. Like the
base weights, A and B are stacked over layers: (L, in, r) and (L, r, out). They are
`nnx.LoRAParam`s, kept in f32 whatever the base dtype (their optimizer updates are tiny).

What that buys, and where it is used:
- training differentiates and keeps AdamW state for the adapters only (`split`: the base is
  a separate, frozen argument of the jitted step; learner.train_step);
- the reference policy of the KL term is the base itself with adapters off: the same arrays
  under the graph without adapters (`LoraParts.base_graphdef`), no second copy of the weights;
- checkpoints hold the adapters and their optimizer state; a resumed run rebuilds the base from
  model.path or preset + seed, as every stage does, and loads the adapters onto it;
- `merge` folds the adapters into the kernels for export: a plain model any HF runtime serves.

Modules are chosen by a regular expression searched (`re.search`) in each linear's path, e.g.
`model.layers.self_attn.q_proj`, the way EasyDeL users write `.*(q_proj|gate_proj|up_proj).*`.
The embedding and the LM head are never adapted.

This module is imported by the run config, which the Prefect process reads: JAX and Flax are
imported inside the functions that need them, never at import time.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
import zlib
from typing import Any, NamedTuple

from grpo_core.config.train import ConfigError, _check, _coerce, _Config

# The linears of a decoder layer (grpo_core.nn.model), as `re.search` sees them.
LAYER_LINEARS = tuple(f"model.layers.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                     "mlp.down_proj"))


@dataclasses.dataclass(frozen=True)
class LoraConfig(_Config):
    """The `model.lora` section: rank, alpha (the update is scaled by alpha / rank) and the
    regex of target modules. dropout exists so that a PEFT-style config gets a clear answer."""

    rank: int = 8
    alpha: float = 16.0
    target_modules: str = ".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # coerced here, not by _normalize: errors say model.lora.*
            object.__setattr__(self, f.name, _coerce(hints[f.name], getattr(self, f.name), f"model.lora.{f.name}"))
        _check(self.rank >= 1, f"model.lora.rank must be a positive integer, got {self.rank}")
        _check(self.alpha > 0 and math.isfinite(self.alpha), f"model.lora.alpha must be > 0, got {self.alpha}")
        # GRPO's ratio compares the policy with the log-probs it sampled with (no dropout); dropout
        # in the update alone would bias every ratio and the clipping with it.
        _check(self.dropout == 0, f"model.lora.dropout must be 0 (dropout in the update alone would bias GRPO's "
                                  f"importance ratios), got {self.dropout}")
        _check(isinstance(self.target_modules, str) and bool(self.target_modules),
               f"model.lora.target_modules must be a regular expression like '.*(q_proj|v_proj).*', "
               f"got {self.target_modules!r}")
        self.select(LAYER_LINEARS)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def select(self, paths) -> list[str]:
        """The paths target_modules finds, or ConfigError listing those it could have found."""
        try:
            pattern = re.compile(self.target_modules)
        except re.error as exc:
            raise ConfigError(f"model.lora.target_modules {self.target_modules!r} is not a valid regular "
                              f"expression: {exc}") from None
        chosen = [p for p in paths if pattern.search(p)]
        _check(bool(chosen), f"model.lora.target_modules {self.target_modules!r} matches none of the modules "
                             f"{', '.join(p.rsplit('.', 1)[-1] for p in paths)} (it is searched in paths like {paths[0]})")
        return chosen

    @classmethod
    def from_value(cls, value: Any) -> "LoraConfig":
        """From the run config's `model.lora`: a mapping, or true for the defaults."""
        if isinstance(value, LoraConfig):
            return value
        if value is True:
            value = {}
        _check(isinstance(value, dict), f"model.lora must be a mapping like {{rank: 8, alpha: 16, target_modules: "
                                        f"'.*(q_proj|v_proj).*'}}, got {value!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(names))
        _check(not unknown, f"model.lora: unknown field(s) {unknown}; known: {names}")
        return cls(**value)


def num_adapter_params(mc, cfg: LoraConfig) -> int:
    """Adapter parameters of ModelConfig `mc` under cfg, without building anything: L * r * (in + out)
    per targeted linear (the readiness stage's memory budget)."""
    h, i = mc.hidden_size, mc.intermediate_size
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    dims = dict(zip(LAYER_LINEARS, [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]))
    return sum(mc.num_hidden_layers * cfg.rank * sum(dims[p]) for p in cfg.select(LAYER_LINEARS))


# -- the model ---------------------------------------------------------------------------------


def _linears(model) -> dict[str, Any]:
    """The decoder layers' linears by path (stacked over layers: one module per kind)."""
    from flax import nnx

    from grpo_core.nn.model import Linear

    out = {}
    for path, node in nnx.iter_graph(model):
        name = ".".join(str(p) for p in path)
        if isinstance(node, Linear) and name.startswith("model.layers."):
            out[name] = node
    return out


def apply(model, cfg: LoraConfig, seed: int = 0):
    """Add adapters to the linears of `model` that cfg.target_modules selects, in place; returns
    the model. A's init depends on (seed, module path) only, so every process builds the same."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    linears = _linears(model)
    if has_adapters(model):
        raise ValueError("the model already has LoRA adapters")
    key = jax.random.key(seed)
    for path in cfg.select(list(linears)):
        lin = linears[path]
        *lead, din, dout = lin.kernel.shape  # (L, in, out)
        bound = 1.0 / math.sqrt(din)
        k = jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)
        lin.lora_a = nnx.LoRAParam(jax.random.uniform(k, (*lead, din, cfg.rank), jnp.float32, -bound, bound))
        lin.lora_b = nnx.LoRAParam(jnp.zeros((*lead, cfg.rank, dout), jnp.float32))
        lin.lora_scale = cfg.scale
    return model


def has_adapters(model) -> bool:
    import jax
    from flax import nnx

    return bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))


class LoraParts(NamedTuple):
    graphdef: Any  # the graph with adapters (policy forward, sampling)
    base_graphdef: Any  # the same graph without them (the reference policy)
    base: Any  # nnx.State of every base weight: frozen
    adapters: Any  # nnx.State of the LoRAParams: trained, checkpointed


def split(model) -> LoraParts:
    """The model's graph with and without adapters, its base weights and its adapters.
    `nnx.merge(graphdef, base, adapters)` is the policy, `nnx.merge(base_graphdef, base)` the
    base: two graphs over the same arrays."""
    from flax import nnx

    graphdef, adapters, base = nnx.split(model, nnx.LoRAParam, ...)
    plain = nnx.merge(graphdef, base, adapters)  # new modules over the same Variables
    for lin in _linears(plain).values():
        _drop(lin)
    return LoraParts(graphdef, nnx.graphdef(plain), base, adapters)


def _drop(lin) -> None:
    lin.lora_a = None
    lin.lora_b = None
    lin.lora_scale = 0.0


def merge(model):
    """A new model whose targeted kernels are W + (alpha / rank) A @ B (in f32, cast back to W's
    dtype) and which has no adapters; `model` itself is left as it was. A model without adapters
    comes back as a copy of itself."""
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, state)  # new modules, but the Variables are shared: replace, never assign into
    for lin in _linears(out).values():
        if lin.lora_a is None:
            continue
        w = lin.kernel[...]
        delta = jnp.einsum("...ir,...ro->...io", lin.lora_a[...].astype(jnp.float32), lin.lora_b[...].astype(jnp.float32))
        lin.kernel = nnx.Param((w.astype(jnp.float32) + lin.lora_scale * delta).astype(w.dtype))
        _drop(lin)
    return out


def num_params(adapters) -> int:
    """Number of adapter parameters in an nnx.State (what trains)."""
    import jax

    return sum(int(x.size) for x in jax.tree.leaves(adapters))
