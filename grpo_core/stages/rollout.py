"""The split layout's rollout process (train.rollout.layout=split): draws the batches of the steps
ahead of the learner with the built-in sampler, on CPU cores of its own (grpo_core.rl.overlap).

    python -m grpo_core.stages.rollout --root RUN_URL [--config FILE] --fd N

The training worker starts it (grpo_core.rl.split.Split) and talks to it over the socket `--fd`, pickled
messages both ways: the learner sends ("start", {first, end, k, version}), then ("version", v,
numpy weights) after each update, and ("stop",); this process answers ("ready", info), ("shape",
(P, Tp)) when a prompt shape first appears (the learner compiles its update for it meanwhile),
("made", overlap.Made) per batch, or ("error", {type, message}) before it exits with that error's
code. It reads the same run (config, data, rewards, tools) as the worker, so every batch is the one
the learner's process would have drawn from the same version (grpo_core.stages.rollout_side).

It never outlives the learner: it asks the kernel to kill it when its parent dies
(PR_SET_PDEATHSIG), it exits when the socket closes, and it runs in a session of its own, deaf to
SIGINT and SIGTERM: a stop reaches the learner, which saves a checkpoint with the batches this
process drew and then stops it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from multiprocessing.connection import Connection

from grpo_core.errors import ExitCode, classify
from grpo_core.launch.processes import ENV_ROLLOUT_CORES, ENV_ROLLOUT_PARENT

_PR_SET_PDEATHSIG = 1


def _tie_to_parent() -> None:
    """Killed with its parent, and deaf to the stop signals the parent handles for both."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the socket's end and the parent watch still end it
        pass
    parent = os.environ.get(ENV_ROLLOUT_PARENT)
    if parent and os.getppid() != int(parent):  # the parent died before the request above
        os._exit(ExitCode.ROLLOUT)


def _pin() -> None:
    """Onto the cores the learner left it, before JAX starts (XLA sizes its thread pool from them)."""
    cores = os.environ.get(ENV_ROLLOUT_CORES)
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
    from grpo_core.rl import split  # rollout start: JAX, after the pinning above
    from grpo_core.stages.rollout_side import serve  # rollout start: JAX

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


if __name__ == "__main__":
    sys.exit(main())
