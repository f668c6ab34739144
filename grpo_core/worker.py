"""The training worker: the process a pipeline task launches and watches.

    python -m grpo_core.worker --config run.json --root URL --until-step N [--checkpoint-every K]

It restores the newest finalised checkpoint under `{root}/checkpoints` (if any, and only one
written for the same config hash), trains until N steps are done in total, and every K steps
writes the metrics shard of those steps and then a checkpoint (outputs first, checkpoint last).
Progress goes to stdout as JSON lines, one object per event:

    {"event": "start" | "resumed", "step": s, "until": N}
    {"event": "step", "step": s, "reward": ..., ...}          # after each step
    {"event": "checkpoint", "step": s, "uri": ...}            # durable: safe to be killed now
    {"event": "done", "step": N, "steps_run": n}
    {"event": "error", "kind": "config" | "reward", "message": ...}

Exit codes: 0 done, 2 config error, 3 reward-function error (neither is worth retrying);
anything else (a crash, a kill, a storage error) is worth retrying: the next run resumes from
the last checkpoint, re-running at most K - 1 steps, whose metric rows then replace their
earlier copies (storage.RunRoot.read_metrics keeps one row per step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

EXIT_CONFIG, EXIT_REWARD = 2, 3
_STEP_KEYS = ("reward", "reward_std", "kl", "entropy", "grad_norm", "learning_rate", "completions/mean_length",
              "time/step")


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def run(cfg: dict[str, Any], root_url: str, until_step: int, checkpoint_every: int) -> int:
    from grpo_core.checkpoint import Checkpointer
    from grpo_core.recipes import build_synthetic
    from grpo_core.rewards import RewardFunctionError
    from grpo_core.storage import RunRoot, config_hash
    from grpo_core.trainer import GRPOTrainer

    from grpo_core.config import ConfigError

    root = RunRoot(root_url)
    run_ = build_synthetic(cfg)
    if until_step > run_.train.num_steps:  # the LR schedule spans train.num_steps: never stretch it
        raise ConfigError(f"--until-step {until_step} is past train.num_steps ({run_.train.num_steps})")
    h = config_hash(cfg)
    trainer = GRPOTrainer(run_.model, run_.train, run_.tokenizer, run_.rewards, run_.task)
    with Checkpointer(root.uri("checkpoints")) as ckpt:
        resumed = trainer.restore(ckpt, config_hash=h)
        start = trainer.step
        _emit("resumed" if resumed else "start", step=start, until=until_step)
        pending: list[dict[str, Any]] = []
        try:
            while trainer.step < until_step:
                m = trainer.train_step()
                pending.append(m)
                _emit("step", **{k: m[k] for k in ("step", *_STEP_KEYS) if k in m})
                if trainer.step % checkpoint_every == 0 or trainer.step == until_step:
                    root.write_metrics(pending)  # outputs first ...
                    trainer.save(ckpt, config_hash=h)  # ... the checkpoint (finalised last) after
                    ckpt.wait()
                    pending = []
                    _emit("checkpoint", step=trainer.step, uri=root.uri("checkpoints", str(trainer.step)))
        except RewardFunctionError as exc:
            _emit("error", kind="reward", message=str(exc))
            return EXIT_REWARD
    _emit("done", step=trainer.step, steps_run=trainer.step - start)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grpo_core.worker", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="JSON file: the run config (recipe sections)")
    ap.add_argument("--root", required=True, help="run root URL: a folder or gs://bucket/prefix/run")
    ap.add_argument("--until-step", type=int, required=True, help="train until this many steps are done")
    ap.add_argument("--checkpoint-every", type=int, default=10)
    args = ap.parse_args(argv)
    from grpo_core.config import ConfigError

    try:
        with open(args.config) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        _emit("error", kind="config", message=f"cannot read config {args.config}: {exc}")
        return EXIT_CONFIG
    t = time.perf_counter()
    try:
        if args.until_step < 0 or args.checkpoint_every < 1:
            raise ConfigError(f"--until-step must be >= 0 and --checkpoint-every >= 1, got "
                              f"{args.until_step} and {args.checkpoint_every}")
        rc = run(cfg, args.root, args.until_step, args.checkpoint_every)
    except ConfigError as exc:
        _emit("error", kind="config", message=str(exc))
        return EXIT_CONFIG
    print(json.dumps({"event": "exit", "code": rc, "seconds": round(time.perf_counter() - t, 3)}), file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
