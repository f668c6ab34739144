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

The section itself (LoraConfig, rank, targets) is JAX-free config: grpo_core.config.model.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_core.config.model import LAYER_LINEARS, LoraConfig, num_adapter_params  # noqa: F401 - lora.num_adapter_params
from grpo_core.nn.model import Linear

# -- the model ---------------------------------------------------------------------------------


def _linears(model) -> dict[str, Any]:
    """The decoder layers' linears by path (stacked over layers: one module per kind)."""

    out = {}
    for path, node in nnx.iter_graph(model):
        name = ".".join(str(p) for p in path)
        if isinstance(node, Linear) and name.startswith("model.layers."):
            out[name] = node
    return out


def apply(model, cfg: LoraConfig, seed: int = 0):
    """Add adapters to the linears of `model` that cfg.target_modules selects, in place; returns
    the model. A's init depends on (seed, module path) only, so every process builds the same."""

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

    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, state)  # new modules, but the Variables are shared: replace, never assign into
    for lin in _linears(out).values():
        if lin.lora_a is None:
            continue
        w = lin.kernel[...]
        delta = jnp.einsum(
            "...ir,...ro->...io", lin.lora_a[...].astype(jnp.float32), lin.lora_b[...].astype(jnp.float32)
        )
        lin.kernel = nnx.Param((w.astype(jnp.float32) + lin.lora_scale * delta).astype(w.dtype))
        _drop(lin)
    return out


def num_params(adapters) -> int:
    """Number of adapter parameters in an nnx.State (what trains)."""

    return sum(int(x.size) for x in jax.tree.leaves(adapters))
