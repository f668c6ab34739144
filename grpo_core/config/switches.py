"""The environment switches that measure the accelerator paths one against another (docs/gpu.md,
"The GPU paths and their switches"). Read when a program is traced; none is in a config hash.
JAX-free, so the memory plan and the model read the same settings, validated once here."""

from __future__ import annotations

import os

from grpo_core.errors import ConfigError

ATTENTION_IMPLS = ("auto", "xla", "cudnn")


def attention() -> str:
    """GRPO_ATTENTION: auto (default), xla or cudnn (grpo_core.nn.model.attention_impl)."""
    want = os.environ.get("GRPO_ATTENTION", "auto").strip().lower() or "auto"
    if want not in ATTENTION_IMPLS:
        raise ConfigError(f"GRPO_ATTENTION={want!r}: use one of {', '.join(ATTENTION_IMPLS)}")
    return want


def on_off(name: str) -> bool | None:
    """A 0|1 switch: True, False, or None where it is unset (the backend's default applies)."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ConfigError(f"{name}={value!r}: 0 or 1")
    return None if value == "" else value == "1"


def decode_unrolled(platform: str) -> bool:
    """GRPO_DECODE_UNROLL=0|1: a decode step's layers as straight code over weights and a KV cache
    laid out per layer (grpo_core.nn.model.CausalLM.layers_apart); default everywhere but a TPU,
    whose compiler reads a layer's slice of the stacked arrays inside its matmuls."""
    want = on_off("GRPO_DECODE_UNROLL")
    return platform != "tpu" if want is None else want


def decode_phases(default: int) -> int:
    """GRPO_DECODE_PHASES: decode loops one after another, each attending to the cache slots it
    can have filled (default: the backend's, grpo_core.generate.sampler.backend_defaults)."""
    value = os.environ.get("GRPO_DECODE_PHASES", "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"GRPO_DECODE_PHASES={value!r}: a whole number of loops, 1 or more")
    return int(value)


def decode_chunk() -> int:
    """GRPO_DECODE_CHUNK: tokens per all-rows-done test of the decode loop (default 1)."""
    value = os.environ.get("GRPO_DECODE_CHUNK", "").strip()
    if not value:
        return 1
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"GRPO_DECODE_CHUNK={value!r}: a whole number of tokens, 1 or more")
    return int(value)
