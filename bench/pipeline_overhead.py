"""Benchmark: the demo flow's overhead, the part of its wall time that is neither training steps
nor evaluation compute (process starts, restores, checkpoints, Prefect's task runs).

    python -m bench.pipeline_overhead [--runs 3] [--baseline DIR]

Each run is `grpo demo` in a fresh folder (its own run root, the CLI's embedded Prefect server),
read back from the run's summary.json: `timing.wall_s` (the flow from its first task to its
summary), `train_steps_s` (the steps' own time, first steps with their compilation included) and
`eval_compute_s`. Overhead = wall − train steps − eval compute; the target is ≤ 25 % of wall.
--baseline DIR: a checkout of another version of this project (say `git worktree add DIR REV`),
run alternately with this one through the same interpreter (DIR first on PYTHONPATH, so its
modules are the ones imported), so that both meet the same machine load.
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


def demo(code: str | None) -> dict[str, float]:
    """One `grpo demo` with `code` (a checkout) first on PYTHONPATH, or this one; its timing."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if code:
        env["PYTHONPATH"] = code
    with tempfile.TemporaryDirectory(prefix="grpo-overhead-") as cwd:
        cli = os.path.join(os.path.dirname(sys.executable), "grpo")
        proc = subprocess.run([cli, "demo"], cwd=cwd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"grpo demo failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        [summary] = glob.glob(os.path.join(cwd, "runs", "*", "summary.json"))
        with open(summary) as f:
            t = json.load(f)["timing"]
    over = t["wall_s"] - t["train_steps_s"] - t["eval_compute_s"]
    return dict(t, overhead_s=over, overhead_pct=100 * over / t["wall_s"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each version (default 3)")
    ap.add_argument("--baseline", help="a checkout of another version, run alternately with this one")
    args = ap.parse_args(argv)
    versions = [("this", None)] + ([("baseline", os.path.abspath(args.baseline))] if args.baseline else [])
    rows: dict[str, list[dict[str, float]]] = {name: [] for name, _ in versions}
    for i in range(args.runs):
        for name, code in versions[::-1] if i % 2 else versions:  # alternate who goes first
            r = demo(code)
            rows[name].append(r)
            print(
                f"{name} run {i + 1}: wall {r['wall_s']:.1f} s, overhead {r['overhead_s']:.1f} s "
                f"({r['overhead_pct']:.1f} %)",
                flush=True,
            )
    head = ("version", "runs", "wall s", "train steps s", "eval compute s", "overhead s", "overhead %")
    print("\n" + " | ".join(head) + "\n" + " | ".join("---" for _ in head))
    med = lambda name, k: statistics.median(r[k] for r in rows[name])
    for name, _ in versions:
        cells = [med(name, k) for k in ("wall_s", "train_steps_s", "eval_compute_s", "overhead_s", "overhead_pct")]
        print(" | ".join([name, str(len(rows[name]))] + [f"{c:.1f}" for c in cells]))
    if args.baseline:
        print(
            f"\nthis / baseline (medians): wall {med('this', 'wall_s') / med('baseline', 'wall_s'):.2f}x, "
            f"overhead {med('this', 'overhead_s') / med('baseline', 'overhead_s'):.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
