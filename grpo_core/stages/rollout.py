"""The split layout's rollout process (train.rollout.layout=split): draws the batches of the steps
ahead of the learner with the built-in sampler, on CPU cores of its own (grpo_core.rl.overlap).

    python -m grpo_core.stages.rollout --root RUN_URL [--config FILE] --fd N

The training worker starts it (grpo_core.rl.split.Split) and talks to it over the socket `--fd`, pickled
messages both ways: the learner sends ("start", {first, end, k, version}), then ("version", v,
numpy weights) after each update, and ("stop",); this process answers ("ready", info), ("shape",
(P, Tp)) when a prompt shape first appears (the learner compiles its update for it meanwhile),
("made", overlap.Made) per batch, or ("error", {type, message}) before it exits with that error's
code. It reads the same run (config, data, rewards, tools) as the worker, so every batch is the one
the learner's process would have drawn from the same version.

It never outlives the learner: it asks the kernel to kill it when its parent dies
(PR_SET_PDEATHSIG), it exits when the socket closes, and it ignores SIGINT and SIGTERM, which its
process group gets with the worker's: the learner saves a checkpoint at a stop, with the batches
this process drew, and then stops it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from grpo_core.errors import ExitCode, classify

_PR_SET_PDEATHSIG = 1


def _tie_to_parent() -> None:
    """Killed with its parent, and deaf to the stop signals the parent handles for both."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the socket's end and the parent watch still end it
        pass
    parent = os.environ.get("GRPO_ROLLOUT_PARENT")
    if parent and os.getppid() != int(parent):  # the parent died before the request above
        os._exit(ExitCode.ROLLOUT)


def _pin() -> None:
    """Onto the cores the learner left it, before JAX starts (XLA sizes its thread pool from them)."""
    cores = os.environ.get("GRPO_ROLLOUT_CORES")
    if cores:
        os.sched_setaffinity(0, [int(c) for c in cores.split(",")])


def main(argv: list[str] | None = None) -> int:
    _tie_to_parent()
    _pin()
    ap = argparse.ArgumentParser(prog="python -m grpo_core.stages.rollout", description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--config")
    ap.add_argument("--fd", type=int, required=True, help="the socket to the learner")
    args = ap.parse_args(argv)
    conn = Connection(args.fd)
    from grpo_core.rl import split  # rollout start: JAX

    try:
        serve(conn, args)
    except Exception as exc:  # noqa: BLE001 - sent to the learner, which fails (or retries) the stage
        failure = classify(exc)
        try:
            split.send(conn, ("error", split.error_report(exc)))
        except OSError:
            pass
        print(f"the rollout process failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if failure is None:
            raise
        return failure.code
    return 0


def serve(conn: Connection, args) -> None:
    import jax  # rollout start: JAX
    from flax import nnx  # rollout start: JAX

    from grpo_core.data.prepare import DatasetPrompts  # rollout start: JAX
    from grpo_core.engines import make_engine  # rollout start: JAX
    from grpo_core.errors import ConfigError  # rollout start: JAX
    from grpo_core.generate.sampler import step_key  # noqa: F401 - imported before the first round
    from grpo_core.nn.model import create_model  # rollout start: JAX
    from grpo_core.rl import overlap, split  # rollout start: JAX
    from grpo_core.rl.learner import score_completions  # rollout start: JAX
    from grpo_core.rl.rollouts import RolloutMaker, sampling_setup  # rollout start: JAX
    from grpo_core.runtime.mesh import Placement  # rollout start: JAX
    from grpo_core.stages.worker import _compilation_cache, _load  # rollout start: JAX

    _compilation_cache()
    parts = _load(args)
    cfg = parts.cfg.train
    t = time.perf_counter()
    kind, *body = split.receive(conn)  # the learner's first version comes right after
    if kind == "stop":  # the stage ended before its first step (nothing left to train)
        return
    if kind != "start":
        raise RuntimeError(f"the learner's first message is {kind!r}, not 'start'")
    hello = body[0]
    mc = hello["model_config"]  # the learner's policy's (a model.init_from run's is the other run's)
    kind, version, weights = split.receive(conn)
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: create_model(mc, 0)))
    try:
        placement = Placement.from_config(cfg.mesh)
    except ConfigError:  # train.mesh names the learner's devices, not these
        placement = Placement.from_config(None)

    def on_device(pure: dict[str, Any]):
        state = jax.tree.map(lambda x: x, shapes)
        nnx.replace_by_pure_dict(state, pure)
        return placement.put_params(state)

    versions = overlap.Versions()
    versions.put(version, on_device(weights))
    threading.Thread(target=_read, args=(conn, versions, on_device), daemon=True, name="versions").start()
    opts, turns = sampling_setup(cfg, parts.tokenizer)
    slot: list = [None]
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
    shapes_seen: set = set()

    def before_round(ptok, pval, key) -> None:
        if ptok.shape in shapes_seen:
            return
        shapes_seen.add(ptok.shape)
        split.send(conn, ("shape", ptok.shape))  # the learner compiles its update for it meanwhile
        for job in engine.compile_jobs(ptok, pval, key, cfg.grpo.num_generations):
            job()

    maker = RolloutMaker(
        cfg,
        parts.tokenizer,
        parts.rewards,
        DatasetPrompts(parts.train_rows, seed=parts.cfg.data.seed),
        engine,
        opts,
        turns,
        {"rewards": 0.0},
        before_round,
    )
    score = None
    if cfg.rollout.learner_logprobs(mc.dtype) and hello["k"] > 0:  # the learner would rescore: in its numerics
        scorer = jax.jit(
            lambda params, batch: score_completions(
                graphdef, params, batch, cfg.sampling.temperature, cfg.logits_chunk_mib, jax.default_backend()
            )
        )

        def score(params, ro):
            c = ro.completions
            return jax.device_get(
                scorer(params, dict(prompt_tokens=ro.prompt_tokens, prompt_valid=ro.prompt_valid, targets=c.tokens))
            )

    split.send(
        conn,
        ("ready", {"pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0)), "start_s": time.perf_counter() - t}),
    )
    side = overlap.RolloutSide(maker, slot, hello["k"], score)
    side.run(hello["first"], hello["end"], versions, lambda made: split.send(conn, ("made", made)))
    threading.Event().wait()  # every batch sent: the learner stops this process (the reader exits it)


def _read(conn: Connection, versions, on_device) -> None:
    """The learner's versions, as they come (each laid out here while the main thread draws); the
    process ends at "stop" or when the learner's end closes."""
    from grpo_core.rl import split  # rollout start: JAX

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


if __name__ == "__main__":
    sys.exit(main())
