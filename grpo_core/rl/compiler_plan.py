"""`train.remat: auto` and `train.grpo.grad_accum_steps: auto` chosen by the local backend's compiler.

On an attached accelerator the fitted formula (grpo_core.config.memory) can say "fits" where XLA's
buffer assignment does not (qwen2.5-0.5b on an H100: the formula 48.1 GiB, XLA one 57.2 GiB
temporaries block, OOM). Here the update of each candidate, cheapest first, is lowered for this
process's devices exactly as the learner will run it (grpo_core.rl.aot.RunPrograms: the same
Learner, meshes and shardings) and compiled; `compiled.memory_analysis()` of the local backend
(GPU, TPU, or CPU) decides, the first candidate whose chip peak fits the device's memory is
chosen. On an accelerator the formula only skips what it says needs 1.5x the device (it errs
low, never that far).

It runs where the device's memory is known: an accelerator's `bytes_limit`, or the budget
GRPO_DEVICE_MEMORY_BYTES sets on any backend (to leave room to other processes, or, on CPU, a
small fake one for tests). On CPU without it the formula, fitted to CPU, chooses alone.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax

from grpo_core.config import memory
from grpo_core.config.model import ModelConfig
from grpo_core.config.train import RematPolicy, TrainConfig
from grpo_core.errors import ConfigError
from grpo_core.rl import aot

log = logging.getLogger(__name__)

BUDGET_ENV = "GRPO_DEVICE_MEMORY_BYTES"
_SKIP = 1.5  # candidates the formula says need this share of the usable memory are not compiled


def device_budget() -> int | None:
    """Bytes per device the compiler's choice must fit: GRPO_DEVICE_MEMORY_BYTES, else an
    accelerator's bytes_limit; None on CPU without the setting (the formula chooses there)."""
    raw = os.environ.get(BUDGET_ENV)
    if raw:
        try:
            value = int(float(raw))
        except ValueError:
            value = 0
        if value <= 0:
            raise ConfigError(f"{BUDGET_ENV} must be a positive number of bytes, got {raw!r}")
        return value
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        return None
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return None if limit is None else int(limit)


def choose(
    model: ModelConfig,
    train: TrainConfig,
    max_prompt_tokens: int,
    lora=None,
    separate_reference: bool = False,
    budget: int | None = None,
    devices: list | None = None,
    cache: aot.ProgramCache | None = None,
    reward_models: tuple[memory.RewardModelShape, ...] = (),
) -> dict[str, Any] | None:
    """The compiler's (remat, accumulation) for the auto fields of `train` on `devices` (default:
    every device of the run), or None when nothing is auto or no budget is known. The report:
    remat, grad_accum_steps, fits, budget_bytes, usable_bytes, backend, seconds, and candidates
    (each with XLA's peak per device, the formula's estimate and its compile time). When none
    fits, the one that needs least, `fits` false. `cache`: XLA's figures per program (a worker
    that starts again for the next epoch compiles nothing). `reward_models`: their weights stay
    on the devices beside the update's (the update's extras count them)."""
    if train.memory_resolved:
        return None
    budget = budget if budget is not None else device_budget()
    if budget is None:
        return None
    t0 = time.perf_counter()
    devices = devices or jax.devices()
    run = aot.RunPrograms(
        model,
        train,
        max_prompt_tokens,
        devices,
        lora=lora,
        separate_reference=separate_reference,
        reward_models=reward_models,
    )
    resident = run.resident()
    backend = devices[0].platform
    layout = memory.Layout() if backend == "cpu" else memory.Layout(*train.mesh.sizes(len(devices)))
    trainable = None if lora is None else memory.num_adapter_params(model, lora)
    usable = aot.HEADROOM * budget

    formula = memory.update_bytes(
        model,
        train,
        max_prompt_tokens,
        trainable=trainable,
        layout=layout,
        backend=backend,
        separate_reference=separate_reference,
    )

    cands = memory.candidates(train, backend=backend)
    tried = []
    # on CPU the formula counts the whole process (the runtime, XLA's programs), never what one
    # program's buffers need: it skips nothing there
    hopeless = lambda c: backend != "cpu" and formula(*c) > _SKIP * usable
    for remat, accum in [c for c in cands if not hopeless(c)] or cands[-1:]:
        lower, extra = run.update(remat, accum)
        # on CPU and GPU XLA compiles what does not fit and reports its size; a TPU refuses it
        r = aot.analyse("update", lower, sum(resident[k] for k in extra), budget, cache)
        r.update(remat=remat.value, grad_accum_steps=accum, formula_bytes=formula(remat, accum))
        tried.append(r)
        log.info(
            "memory: XLA (%s) says the update with remat=%s, accum=%d needs %s bytes per device (%s)",
            backend,
            remat.value,
            accum,
            r["peak_bytes"],
            "fits" if r["fits"] else "does not fit",
        )
        if r["fits"]:
            break
    best = tried[-1] if tried[-1]["fits"] else min(tried, key=lambda r: r["peak_bytes"] or float("inf"))
    keys = ("remat", "grad_accum_steps", "fits", "xla_peak_bytes", "peak_bytes", "formula_bytes", "compile_s", "cached")
    report = {
        "source": "xla",
        "backend": backend,
        "remat": best["remat"],
        "grad_accum_steps": best["grad_accum_steps"],
        "fits": best["fits"],
        "peak_bytes": best["peak_bytes"],
        "budget_bytes": budget,
        "usable_bytes": int(usable),
        "candidates": [{k: r.get(k) for k in keys} for r in tried],
        "seconds": round(time.perf_counter() - t0, 2),
    }
    return dict(report, describe=describe(report))


def describe(report: dict[str, Any]) -> str:
    """One line for choose()'s report, as the train task logs it."""

    def size(b: int | None) -> str:
        return "?" if b is None else f"{b / 2**30:.2f} GiB" if b >= 2**28 else f"{b / 2**20:.1f} MiB"

    tried = ", ".join(
        f"{c['remat']}/{c['grad_accum_steps']} {size(c['peak_bytes'])}{'' if c['fits'] else ' (does not fit)'}"
        for c in report["candidates"]
    )
    verdict = "chose" if report["fits"] else "found nothing that fits; kept the least,"
    return (
        f"XLA ({report['backend']}) {verdict} train.remat={report['remat']}, "
        f"train.grpo.grad_accum_steps={report['grad_accum_steps']}: {size(report['peak_bytes'])} of "
        f"{size(report['usable_bytes'])} usable per device (candidates: {tried}; {report['seconds']} s)"
    )


def resolve(train: TrainConfig, choice: dict[str, Any]) -> TrainConfig:
    """`train` with remat and grad_accum_steps as the compiler chose them."""
    return train.replace(
        remat=RematPolicy(choice["remat"]), grpo=train.grpo.replace(grad_accum_steps=int(choice["grad_accum_steps"]))
    )
