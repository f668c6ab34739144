"""Rollout engines: what draws each step's completions, behind one interface.

    engine = make_engine(cfg.rollout, graphdef=..., params_fn=..., model_config=..., opts=..., ...)
    out = engine.generate(prompt_tokens, prompt_valid, key, num_samples)  # numpy `Completions`
    engine.sync(params, step)  # after each optimizer step: the engine serves the new policy
    engine.close()

- `jax` (JaxEngine, the default): grpo_core.generate.sampler in the learner's own process and devices;
  works on any backend and on multi-host slices.
- `sglang` (SglangEngine): sglang-jax in the same process, single host. Its model is built
  from the policy's config with dummy weights; every sync assigns the policy's weights to the
  engine's state in memory (no files). Needs the .venv-sglang interpreter (sglang-jax pins
  older jax/flax/fastapi than the main environment holds).
- `http` (HttpEngine): an OpenAI-compatible server (sglang-jax, SGLang, vLLM). Every
  `sync_every` steps the policy is exported as a Hugging Face folder and the server made to
  serve it: a reload route when the server has one, else a restart of a server this engine owns.

The returned log-probs are the behaviour policy's old_logp under softmax(logits / T) before
top-k/top-p filtering (our sampler's convention, and sglang-jax's: it takes log(softmax(logits
/ T)) of the processed logits). Where the learner's numerics should define them instead,
RolloutConfig.learner_logprobs has the trainer rescore the completions.

Never hang: engine start, each generate call and each weight sync wait at most the configured
time, then raise RolloutTimeout naming what was waited for (or, where the wait cannot be
interrupted, end the process with that message: see `watchdog`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np

from grpo_core.config.train import RolloutEngineKind
from grpo_core.engines.jax_engine import JaxEngine  # the built-in engine: it imports nothing from here
from grpo_core.errors import ExitCode, RolloutError, RolloutTimeout
from grpo_core.generate.types import Completions  # the rows every engine returns, as the built-in sampler does

log = logging.getLogger(__name__)


class RolloutEngine(Protocol):
    name: str
    synced_step: int | None  # the training step whose weights it serves (None: not yet synced)

    def generate(self, prompt_tokens: np.ndarray, prompt_valid: np.ndarray, key, num_samples: int) -> Completions:
        """prompt_tokens/valid: (P, Tp) left-padded; key: the step's PRNG key. -> B = P * G rows
        on the host (numpy), rows i*G .. i*G+G-1 following prompt i."""

    def sync(self, params, step: int) -> float:
        """Serve `params` (the plain policy's nnx.State after `step` steps); returns seconds spent."""

    def compile_jobs(self, prompt_tokens, prompt_valid, key, num_samples: int) -> list[Callable[[], Any]]:
        """Compilations to run ahead of the first rollout of this prompt shape (may be empty)."""

    def close(self) -> None: ...


def finish_rows(
    rows: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    n: int,
    eos_ids: Sequence[int],
    pad_id: int,
    who: str,
) -> Completions:
    """Pad per-row completions from an external engine to the sampler's layout: each row ends
    at its first stop token (kept, as the sampler keeps it) and is truncated without one."""
    b = len(rows)
    tokens = np.full((b, n), pad_id, np.int32)
    lps = np.zeros((b, n), np.float32)
    lengths = np.zeros((b,), np.int32)
    truncated = np.ones((b,), bool)
    stops = set(int(e) for e in eos_ids)
    for i, (ids, lp) in enumerate(zip(rows, logprobs)):
        if len(ids) != len(lp):
            raise RolloutError(f"{who}: row {i} has {len(ids)} tokens but {len(lp)} log-probs")
        if len(ids) == 0:
            raise RolloutError(f"{who}: row {i} came back empty (max_new_tokens={n})")
        end = next((j + 1 for j, t in enumerate(ids) if int(t) in stops), None)
        if end is None and len(ids) > n:
            raise RolloutError(f"{who}: row {i} has {len(ids)} tokens, more than max_new_tokens={n}")
        end = end if end is not None else len(ids)
        tokens[i, :end], lps[i, :end] = ids[:end], lp[:end]
        lengths[i] = end
        truncated[i] = int(ids[end - 1]) not in stops
    return Completions(tokens=tokens, logprobs=lps, lengths=lengths, truncated=truncated)


def row_seeds(key, rows: int) -> np.ndarray:
    """Per-row sampling seeds (int32 range) from a step's PRNG key: a resumed step draws the same."""

    data = np.asarray(jax.random.key_data(key)).astype(np.uint64).ravel()
    return np.random.default_rng(data.tolist()).integers(1, 2**31 - 1, size=rows)


def prompt_lists(prompt_tokens: np.ndarray, prompt_valid: np.ndarray, num_samples: int) -> list[list[int]]:
    """Left-padded (P, Tp) prompts -> B = P * G unpadded token lists, each prompt G times."""
    prompts = [np.asarray(t)[np.asarray(v, bool)].tolist() for t, v in zip(prompt_tokens, prompt_valid)]
    return [p for p in prompts for _ in range(num_samples)]


def wait_for(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Run `fn` in a daemon thread and wait at most timeout_s for it: for blocking device waits
    the calling thread cannot interrupt. On timeout the thread is abandoned (the caller must
    treat the engine as broken) and RolloutTimeout says what was waited for."""
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True, name=f"wait:{what[:40]}")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise RolloutTimeout(f"waited {timeout_s:g} s for {what}; gave up")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class watchdog:  # noqa: N801  (used like a function: `with watchdog(seconds, what):`)
    """`with watchdog(seconds, what):` for waits that must run in the main thread and cannot be
    interrupted (sglang-jax's engine start installs signal handlers, so it cannot move to a
    helper thread). If the block outlives its limit, the message goes to stderr and the process
    ends with ExitCode.ROLLOUT, the worker's code for a failed engine: its task reports it and may retry."""

    def __init__(self, timeout_s: float, what: str):
        self.timeout_s, self.what = timeout_s, what
        self._done = threading.Event()

    def _watch(self) -> None:
        if not self._done.wait(self.timeout_s):
            msg = f"waited {self.timeout_s:g} s for {self.what}; gave up and ended the process"
            log.error(msg)
            print(msg, file=sys.stderr, flush=True)
            os._exit(ExitCode.ROLLOUT)

    def __enter__(self):
        threading.Thread(target=self._watch, daemon=True, name="watchdog").start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        return False


def make_engine(
    cfg,
    *,
    graphdef,
    params_fn: Callable[[], Any],
    model_config,
    opts,
    batch_size: int,
    tokenizer=None,
    seed: int = 0,
    placement=None,
) -> RolloutEngine:
    """The engine `cfg` (a RolloutConfig) names. params_fn returns the policy's current params
    (the built-in engine reads them at each call; the others are sent them by `sync`).
    `placement` (grpo_core.runtime.mesh): the built-in engine's rollout mesh."""
    if cfg.engine is RolloutEngineKind.JAX:
        return JaxEngine(graphdef, params_fn, opts, placement)
    if cfg.engine is RolloutEngineKind.SGLANG:
        from grpo_core.engines.sglang import SglangEngine  # a cycle: sglang imports this package's base types

        return SglangEngine(cfg, model_config, opts, batch_size, seed=seed)
    from grpo_core.engines.http import HttpEngine  # a cycle, as sglang

    return HttpEngine(cfg, graphdef, model_config, opts, batch_size, tokenizer=tokenizer, seed=seed)
