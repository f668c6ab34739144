"""sglang-jax in the worker's own process, its weights synced from the policy in memory.

The engine is built from the policy's config (a config.json written to a temporary folder),
with dummy weights, no tokenizer (token ids in and out) and the prefix (radix) cache off: a
cached prefix would hold KV computed by older weights. sglang-jax has no weight-update API;
its model runner keeps the model's state as a flat list, `model_runner.model_state_leaves`, in
the leaf order of `nnx.split(model)`, and every forward reads that list. A sync builds new
leaves from our parameters (one jitted conversion: layer slices of our stacked (L, ...)
parameters, the LM head transposed to (V, E), the engine's dtype, k/v heads replicated where
tensor parallelism pads them), puts each on the engine leaf's sharding and assigns the list
between generate calls. Names map one to one: the engine's `model.layers.{i}.self_attn.q_proj
.weight` (in, out) is row i of our `model.layers.self_attn.q_proj.kernel` (L, in, out);
`...norm.scale` is our `...norm.weight`.

Why a separate process and interpreter: an internal error in sglang-jax's scheduler ends its
whole process (SIGQUIT to itself), and sglang-jax 0.1.x needs Python 3.12 with older jax, flax
and fastapi pins. The training worker is therefore started with the .venv-sglang interpreter;
tests drive this engine through a child process of it (grpo_core.stages.engine_selftest).

Known limits: single host only (multi-host slices fail inside sglang-jax), TPU v4 or newer; on
CPU (tests) the native attention path needs head_dim to be a multiple of 128.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_core.config.model import hf_config
from grpo_core.engines import (
    Completions,
    RolloutError,
    RolloutTimeout,
    finish_rows,
    prompt_lists,
    row_seeds,
    wait_for,
    watchdog,
)

log = logging.getLogger(__name__)


def leaf_names(model) -> list[str]:
    """Dotted paths of an NNX model's state leaves, in tree_flatten order."""

    _, state = nnx.split(model)
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        names.append(".".join(p for p in parts if p not in ("", "value")))
    return names


def source_of(name: str) -> tuple[tuple[str, ...], int | None, bool]:
    """An engine leaf name -> (our parameter path, layer index or None, transpose).

    Engine linears are `.weight` stored (in, out), as our kernels are; norms are `.scale`;
    the untied LM head is an embedding table (V, E) where ours is a kernel (E, V)."""
    parts = name.split(".")
    mods, leaf = parts[:-1], parts[-1]
    layer = None
    if mods[:2] == ["model", "layers"] and len(mods) > 2 and mods[2].isdigit():
        layer, mods = int(mods[2]), ["model", "layers", *mods[3:]]
    if mods == ["lm_head"] and leaf == "embedding":
        return ("lm_head", "kernel"), None, True
    ours = {"embedding": "embedding", "scale": "weight", "weight": "kernel", "bias": "bias"}.get(leaf)
    if ours is None:
        raise RolloutError(f"sglang-jax parameter {name} has no counterpart in the policy (unknown leaf kind {leaf!r})")
    return (*mods, ours), layer, False


def plan_sync(names: list[str], engine_leaves: list, ours: dict[tuple[str, ...], Any]) -> list[tuple]:
    """One entry per engine leaf: (our path, layer, transpose, kv replicas, dtype, shape).
    Fails naming the first leaf without a source or with a shape no rule explains; every policy
    parameter must feed some leaf (an unused one means the engine runs another model)."""
    plan, used = [], set()
    for name, leaf in zip(names, engine_leaves):
        shape = tuple(leaf.shape)
        if shape == (0,):  # sglang-jax's placeholder for a slot a quantized layer leaves empty
            plan.append(None)
            continue
        path, layer, transpose = source_of(name)
        if path not in ours:
            raise RolloutError(f"sglang-jax parameter {name} has no counterpart in the policy: no {'.'.join(path)}")
        used.add(path)
        src = tuple(ours[path].shape)
        src = src[1:] if layer is not None else src
        src = src[::-1] if transpose else src
        reps = 1
        if src != shape:
            # Tensor parallelism wider than the k/v heads: the engine repeats each head's block.
            kv = path[-2] in ("k_proj", "v_proj") and src[:-1] == shape[:-1] and shape[-1] % src[-1] == 0
            if not kv:
                raise RolloutError(
                    f"sglang-jax parameter {name} has shape {shape}, the policy's {'.'.join(path)} "
                    f"gives {src}: the engine was built for another model"
                )
            reps = shape[-1] // src[-1]
        plan.append((path, layer, transpose, reps, str(leaf.dtype), shape))
    unused = sorted(".".join(p) for p in set(ours) - used)
    if unused:
        raise RolloutError(
            f"policy parameters {unused[:5]} feed no sglang-jax parameter: the engine runs another model"
        )
    return plan


def make_converter(plan: list[tuple], head_dim: int):
    """A jitted function: our flat parameters -> the engine's new leaves (fresh buffers, except
    where a leaf is our array unchanged, which the caller copies)."""

    def convert(flat):
        out = []
        for entry in plan:
            if entry is None:
                out.append(None)
                continue
            path, layer, transpose, reps, dtype, _ = entry
            x = flat[path]
            x = x[layer] if layer is not None else x
            x = x.T if transpose else x
            if reps > 1:  # (..., K*D) -> (..., K*reps*D), each head's block repeated in place
                lead = x.shape[:-1]
                x = jnp.repeat(x.reshape(*lead, -1, head_dim), reps, axis=-2).reshape(*lead, -1)
            out.append(x.astype(dtype))
        return out

    return jax.jit(convert)


def flat_params(params) -> dict[tuple[str, ...], Any]:
    """{path: array} of a plain policy's nnx.State (or pure dict)."""

    pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    return {tuple(str(k.key) for k in p): v for p, v in jax.tree_util.tree_flatten_with_path(pure)[0]}


def sampling_params(opts, rows: int, seeds: np.ndarray | None) -> list[dict[str, Any]] | dict[str, Any]:
    """Our SamplerOptions as sglang sampling params: stop ids kept in the output (no special-token
    skipping), top_k 0 -> -1 (off); with seeds, one dict per row."""
    sp: dict[str, Any] = {
        "max_new_tokens": opts.max_new_tokens,
        "temperature": opts.temperature,
        "top_p": opts.top_p,
        "top_k": opts.top_k if opts.top_k > 0 else -1,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if opts.eos_ids:
        sp["stop_token_ids"] = [int(e) for e in opts.eos_ids]
    else:
        sp["ignore_eos"] = True
    if seeds is None:
        return sp
    return [dict(sp, sampling_seed=int(s)) for s in seeds[:rows]]


def sglang_jax_args(
    cfg, model_path: str, *, device: str, dtype: str, batch_size: int, max_new_tokens: int, seed: int, **own: Any
) -> dict[str, Any]:
    """The arguments sglang-jax starts with for this policy, as its ServerArgs field names, in the
    order the server's command line lists them: one set for the in-process engine (keyword
    arguments of Engine) and the server the http engine starts (grpo_core.engines.http
    .sglang_jax_command turns them into `--flag value`). `own`: what only one of them passes
    (the engine's dummy weights, the server's host and port), placed after model_path.

    Radix cache off (a cached prefix would hold KV of older weights); on CPU the native attention
    backend and a bounded KV cache (sglang would size it by host RAM); a switch is always present,
    True or False; an optional setting only when set."""
    args: dict[str, Any] = dict(
        model_path=model_path,
        **own,
        device=device,
        grammar_backend="none",
        disable_radix_cache=True,
        skip_server_warmup=True,
        random_seed=int(seed),
        log_level="warning",
        dtype=dtype,
        max_running_requests=cfg.max_running_requests or batch_size,
    )
    if device == "cpu" or cfg.attention_backend:
        args["attention_backend"] = cfg.attention_backend or "native"
    if device == "cpu" or cfg.max_total_tokens:
        args["max_total_tokens"] = cfg.max_total_tokens or max(8192, batch_size * (max_new_tokens + 512))
    for name in ("context_length", "mem_fraction_static"):
        if getattr(cfg, name) is not None:
            args[name] = getattr(cfg, name)
    args.update(
        disable_precompile=cfg.disable_precompile,
        enable_deterministic_sampling=cfg.deterministic,
        disable_overlap_schedule=not cfg.overlap_schedule,
    )
    return args


def write_model_folder(model_config, dtype: str) -> str:
    """A folder holding only config.json: enough for sglang-jax to build the model with dummy weights."""
    folder = tempfile.mkdtemp(prefix="grpo-sglang-model-")
    cfg = dict(hf_config(model_config), torch_dtype=dtype, dtype=dtype)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return folder


class SglangEngine:
    name = "sglang"

    def __init__(self, cfg, model_config, opts, batch_size: int, seed: int = 0):

        try:
            from sgl_jax.srt.entrypoints.engine import Engine  # optional: only .venv-sglang has it
        except ImportError as exc:
            raise RolloutError(
                f"train.rollout.engine=sglang needs sglang-jax, which {sys.executable} cannot import "
                f"({exc}): start the training worker with the .venv-sglang interpreter (make "
                "sglang-env; the pipeline does this itself, or set pipeline.worker_python / "
                "GRPO_SGLANG_PYTHON)"
            ) from None
        self.cfg, self.opts, self.batch_size = cfg, opts, batch_size
        self.synced_step: int | None = None
        self.head_dim = model_config.head_dim
        backend = jax.default_backend()
        dtype = cfg.dtype or model_config.dtype.value
        self._folder = write_model_folder(model_config, dtype)
        kw = sglang_jax_args(
            cfg,
            self._folder,
            device="cpu" if backend == "cpu" else "tpu",
            dtype=dtype,
            batch_size=batch_size,
            max_new_tokens=opts.max_new_tokens,
            seed=seed,
            load_format="dummy",
            skip_tokenizer_init=True,
            enable_single_process=True,
        )
        t = time.perf_counter()
        with watchdog(
            cfg.start_timeout_s, f"the sglang-jax engine to start on {backend} (train.rollout.start_timeout_s)"
        ):
            try:
                self.engine = Engine(**kw)
            except Exception as exc:
                raise RolloutError(f"the sglang-jax engine did not start: {type(exc).__name__}: {exc}") from exc
        self.start_s = time.perf_counter() - t
        self.runner = self.engine.scheduler_info["scheduler"].tp_worker.worker.model_runner
        self.names = leaf_names(self.runner.model)
        if len(self.names) != len(self.runner.model_state_leaves):
            raise RolloutError(
                f"sglang-jax's model has {len(self.names)} state leaves but its runner holds "
                f"{len(self.runner.model_state_leaves)}: this sglang-jax version is not supported"
            )
        self._plan = self._convert = None
        self.sync_times: list[float] = []
        log.info(
            "sglang-jax engine started in %.1f s (%s, %s, %d leaves)", self.start_s, backend, dtype, len(self.names)
        )

    def compile_jobs(self, prompt_tokens, prompt_valid, key, num_samples: int):
        return []  # sglang-jax compiles its own programs (at start unless disable_precompile)

    def sync(self, params, step: int) -> float:
        """Assign the policy's weights to the engine (between generate calls: none is in flight)."""

        t = time.perf_counter()
        flat = flat_params(params)
        current = self.runner.model_state_leaves
        if self._plan is None:
            self._plan = plan_sync(self.names, current, flat)
            self._convert = make_converter(self._plan, self.head_dim)

        def build():
            new = self._convert(flat)
            out = []
            for entry, x, cur in zip(self._plan, new, current):
                if entry is None:
                    out.append(cur)
                    continue
                # may_alias=False: a leaf that is our array unchanged must not share its buffer,
                # which the next optimizer step donates.
                out.append(jax.device_put(x, cur.sharding, may_alias=False))
            return jax.block_until_ready(out)

        what = f"the weight sync of step {step} into sglang-jax (train.rollout.sync_timeout_s)"
        new_leaves = wait_for(build, self.cfg.sync_timeout_s, what)
        self.runner.model_state_leaves = new_leaves
        self._release_dummy(new_leaves)
        self.synced_step = step
        dt = time.perf_counter() - t
        self.sync_times.append(dt)
        return dt

    def _release_dummy(self, leaves) -> None:
        """Point the runner's model at the new arrays too, so the start-up dummy weights (or the
        previous step's) are freed instead of held by the module."""

        if getattr(self, "_state_def", None) is None:
            self._state_def = jax.tree_util.tree_structure(nnx.split(self.runner.model)[1])
        try:
            nnx.update(self.runner.model, jax.tree_util.tree_unflatten(self._state_def, leaves))
        except Exception as exc:  # noqa: BLE001 - only memory is at stake
            log.warning("could not release sglang-jax's previous weights: %s", exc)

    def generate(self, prompt_tokens, prompt_valid, key, num_samples: int) -> Completions:
        if self.synced_step is None:
            raise RolloutError("the sglang-jax engine holds dummy weights: sync() the policy before generating")
        ids = prompt_lists(prompt_tokens, prompt_valid, num_samples)
        seeds = row_seeds(key, len(ids)) if self.cfg.deterministic else None
        sp = sampling_params(self.opts, len(ids), seeds)
        coro = self.engine.async_generate(input_ids=ids, sampling_params=sp, return_logprob=True)
        limit = self.cfg.generate_timeout_s
        try:
            out = self.engine.loop.run_until_complete(asyncio.wait_for(coro, limit))
        except asyncio.TimeoutError:
            raise RolloutTimeout(
                f"waited {limit:g} s for sglang-jax to generate {len(ids)} completions of up to "
                f"{self.opts.max_new_tokens} tokens (train.rollout.generate_timeout_s)"
            ) from None
        out = out if isinstance(out, list) else [out]
        rows, lps = [], []
        for i, o in enumerate(out):
            toks = o["output_ids"]
            pairs = o["meta_info"]["output_token_logprobs"]
            if [int(p[1]) for p in pairs] != [int(t) for t in toks]:
                raise RolloutError(f"sglang-jax row {i}: the log-probs belong to other tokens than output_ids")
            rows.append(toks)
            lps.append([float(p[0]) for p in pairs])
        return finish_rows(rows, lps, self.opts.max_new_tokens, self.opts.eos_ids, self.opts.pad_id, "sglang-jax")

    def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            try:
                wait_for(engine.shutdown, 30.0, "the sglang-jax engine to shut down")
            except Exception as exc:  # noqa: BLE001 - the process is ending anyway
                log.warning("sglang-jax shutdown: %s", exc)
        shutil.rmtree(getattr(self, "_folder", ""), ignore_errors=True)
