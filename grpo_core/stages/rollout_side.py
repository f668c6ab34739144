"""The split layout's rollout process, past its start (grpo_core.stages.rollout ties it to the
learner and pins it to its cores before JAX loads, then calls `serve`): it reads the run as the
worker does, builds the policy from the learner's first version, and draws the batches ahead
(grpo_core.rl.overlap.RolloutSide) while a reader thread takes each new version as it comes.
Messages: grpo_core.rl.split."""

from __future__ import annotations

import os
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

import jax
from flax import nnx

from grpo_core.data.prepare import DatasetPrompts
from grpo_core.engines import make_engine
from grpo_core.errors import ConfigError, ExitCode
from grpo_core.nn.model import create_model
from grpo_core.rl import overlap, split
from grpo_core.rl.learner import score_completions
from grpo_core.rl.rollouts import RolloutMaker, sampling_setup
from grpo_core.runtime.mesh import Placement
from grpo_core.stages.worker import _compilation_cache, _load


def serve(conn: Connection, args) -> None:
    """Draw the batches the learner's "start" asks for, then wait to be stopped."""
    _compilation_cache()
    parts = _load(args)
    kind, *body = split.receive(conn)
    if kind == "stop":  # the stage ended before its first step (nothing left to train)
        return
    if kind != "start":
        raise RuntimeError(f"the learner's first message is {kind!r}, not 'start'")
    hello = body[0]
    _, version, weights = split.receive(conn)  # the starting version comes right after
    graphdef, placement, on_device = _policy(hello["model_config"], parts.cfg.train)
    versions = overlap.Versions()
    versions.put(version, on_device(weights))
    threading.Thread(target=_read, args=(conn, versions, on_device), daemon=True, name="versions").start()
    slot: list = [None]
    maker = _maker(conn, parts, graphdef, placement, hello["model_config"], slot)
    score = _scorer(graphdef, parts.cfg.train, hello["model_config"], hello["k"])
    split.send(conn, ("ready", {"pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0))}))
    side = overlap.RolloutSide(maker, slot, hello["k"], score)
    side.run(hello["first"], hello["end"], versions, lambda made: split.send(conn, ("made", made)))
    threading.Event().wait()  # every batch sent: the learner stops this process (the reader exits it)


def _policy(mc, cfg):
    """(graphdef, placement, on_device): the plain model of `mc` (the learner's policy's config: a
    model.init_from run's is the other run's) and how a version's numpy weights become its state
    on this process's devices."""
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: create_model(mc, 0)))
    try:
        placement = Placement.from_config(cfg.mesh)
    except ConfigError:  # train.mesh names the learner's devices, not these
        placement = Placement.from_config(None)

    def on_device(pure: dict[str, Any]):
        state = jax.tree.map(lambda x: x, shapes)
        nnx.replace_by_pure_dict(state, pure)
        return placement.put_params(state)

    return graphdef, placement, on_device


def _maker(conn: Connection, parts, graphdef, placement, mc, slot: list) -> RolloutMaker:
    """What draws a batch here: the run's engine, prompts, rewards and episodes, the policy in
    `slot[0]`; a prompt shape met first is told to the learner (it compiles its update meanwhile)."""
    cfg = parts.cfg.train
    opts, turns = sampling_setup(cfg, parts.tokenizer)
    engine = make_engine(
        cfg.rollout,
        graphdef=graphdef,
        params_fn=lambda: slot[0],
        model_config=mc,
        opts=opts,
        batch_size=cfg.grpo.batch_size,
        tokenizer=parts.tokenizer,
        seed=cfg.seed,
        placement=placement,
    )
    seen: set = set()

    def before_round(ptok, pval, key) -> None:
        if ptok.shape in seen:
            return
        seen.add(ptok.shape)
        split.send(conn, ("shape", ptok.shape))
        for job in engine.compile_jobs(ptok, pval, key, cfg.grpo.num_generations):
            job()

    prompts = DatasetPrompts(parts.train_rows, seed=parts.cfg.data.seed)
    timers = {"rewards": 0.0}
    return RolloutMaker(cfg, parts.tokenizer, parts.rewards, prompts, engine, opts, turns, timers, before_round)


def _scorer(graphdef, cfg, mc, k: int):
    """Where the learner would rescore the sampler's log-probs (RolloutConfig.learner_logprobs) and
    batches lag (k >= 1): (params, rollout) -> the drawing version's log-probs in the learner's
    numerics, which this process alone holds; else None."""
    if not (cfg.rollout.learner_logprobs(mc.dtype) and k > 0):
        return None
    scorer = jax.jit(
        lambda params, batch: score_completions(
            graphdef, params, batch, cfg.sampling.temperature, cfg.logits_chunk_mib, jax.default_backend()
        )
    )

    def score(params, ro):
        batch = dict(prompt_tokens=ro.prompt_tokens, prompt_valid=ro.prompt_valid, targets=ro.completions.tokens)
        return jax.device_get(scorer(params, batch))

    return score


def _read(conn: Connection, versions: overlap.Versions, on_device) -> None:
    """The learner's versions, as they come (each laid out here while the main thread draws); the
    process ends at "stop" or when the learner's end closes."""
    while True:
        try:
            kind, *body = split.receive(conn)
        except (EOFError, OSError):
            os._exit(0)
        if kind == "stop":
            os._exit(0)
        if kind == "version":
            try:
                versions.put(body[0], on_device(body[1]))
            except Exception as exc:  # noqa: BLE001 - the main thread would wait for it for ever
                split.send(conn, ("error", split.error_report(exc)))
                print(f"the rollout process could not take version {body[0]}: {exc!r}", file=sys.stderr, flush=True)
                os._exit(ExitCode.ROLLOUT)
