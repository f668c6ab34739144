"""Benchmark: the demo flow's overhead, the part of its wall time that is neither training steps
nor evaluation compute (process starts, restores, checkpoints, Prefect's task runs).

    python -m bench.pipeline_overhead [--runs 3] [--baseline DIR] [--set key=value ...]

Each run is `grpo demo` in a fresh folder (its own run root, the CLI's embedded Prefect server),
or, with --set, `grpo run --set ...` (an accelerator's shape, e.g. --set model.preset=qwen2.5-0.5b
--set train.num_steps=6 --set pipeline.epochs=2), read back from the run's summary.json:
`timing.wall_s` (the flow from its first task to its summary), `train_steps_s` (the steps' own
time, first steps with their compilation included) and `eval_compute_s`. Overhead = wall − train
steps − eval compute; the target is ≤ 25 % of wall.
--baseline DIR: a checkout of another version of this project (say `git worktree add DIR REV`),
run alternately with this one through the same interpreter (DIR first on PYTHONPATH, so its
modules are the ones imported), so that both meet the same machine load. The CLI runs as
`python -m flows.cli`, so a machine where the project is not installed (PYTHONPATH holding its
dependencies) runs it too. --cold-cache: each run compiles as a user's first run does (a JAX
compilation cache of its own, empty at the start; the stages of one run still share it).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo(code: str | None, sets: list[str], cold_cache: bool = False) -> dict[str, float]:
    """One `grpo demo` (or `grpo run --set ...`) with `code` (a checkout) first on PYTHONPATH, or
    this one; its timing."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (code or ROOT, env.get("PYTHONPATH")) if p)
    argv = ["run", *(a for kv in sets for a in ("--set", kv))] if sets else ["demo"]
    with tempfile.TemporaryDirectory(prefix="grpo-overhead-") as cwd:
        if cold_cache:
            env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(cwd, "jax-cache")
        proc = subprocess.run(
            [sys.executable, "-m", "flows.cli", *argv], cwd=cwd, env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise SystemExit(
                f"grpo {argv[0]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        [summary] = glob.glob(os.path.join(cwd, "runs", "*", "summary.json"))
        with open(summary) as f:
            t = json.load(f)["timing"]
    over = t["wall_s"] - t["train_steps_s"] - t["eval_compute_s"]
    return dict(t, overhead_s=over, overhead_pct=100 * over / t["wall_s"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each version (default 3)")
    ap.add_argument("--baseline", help="a checkout of another version, run alternately with this one")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="grpo run --set")
    ap.add_argument("--cold-cache", action="store_true", help="each run with an empty JAX compilation cache")
    args = ap.parse_args(argv)
    versions = [("this", None)] + ([("baseline", os.path.abspath(args.baseline))] if args.baseline else [])
    rows: dict[str, list[dict[str, float]]] = {name: [] for name, _ in versions}
    for i in range(args.runs):
        for name, code in versions[::-1] if i % 2 else versions:  # alternate who goes first
            r = demo(code, args.sets, args.cold_cache)
            rows[name].append(r)
            print(
                f"{name} run {i + 1}: wall {r['wall_s']:.1f} s, overhead {r['overhead_s']:.1f} s "
                f"({r['overhead_pct']:.1f} %)",
                flush=True,
            )
    columns = {
        "wall s": "wall_s",
        "train steps s": "train_steps_s",
        "of which first steps": "first_steps_s",
        "eval compute s": "eval_compute_s",
        "overhead s": "overhead_s",
        "overhead %": "overhead_pct",
    }
    head = ("version", "runs", *columns)
    print("\n" + " | ".join(head) + "\n" + " | ".join("---" for _ in head))
    med = lambda name, k: statistics.median(r[k] for r in rows[name])
    for name, _ in versions:
        cells = [med(name, k) for k in columns.values()]
        print(" | ".join([name, str(len(rows[name]))] + [f"{c:.1f}" for c in cells]))
    if args.baseline:
        print(
            f"\nthis / baseline (medians): wall {med('this', 'wall_s') / med('baseline', 'wall_s'):.2f}x, "
            f"overhead {med('this', 'overhead_s') / med('baseline', 'overhead_s'):.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
