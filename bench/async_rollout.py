"""Benchmark: asynchronous rollouts (train.max_staleness, train.rollout.layout) on this machine's cores.

    python -m bench.async_rollout [--json F] [--workload demo|larger|all] [--steps N]

Each workload trains four times as a run's training worker trains it (python -m
grpo_core.stages.worker train --then-eval N, in a run folder of its own, XLA's optimisations on):
colocated k=0 (the synchronous run: one process, every core), split k=0, split k=1 and split k=2
(train.rollout.layout=split: the rollout in a second process on one core, the learner on the
other). "demo" is `grpo demo`'s workload (the tiny preset reversing 3-letter words, 16 prompts x 8
completions, dynamic sampling) for its 600 steps; "larger" the same task on the small preset
(hidden 512, 8 layers) for fewer steps.

Reported per run: steps/s over the steps after the first WARMUP (compilation), timed by the step
events' arrival; the busy fraction of each side over that window and the slower side's
(`slow_side_busy`: split, the rollout process's seconds drawing and scoring, and the learner's wall
time less its waits for batches; colocated, each side's seconds in the step's split); the greedy
held-out accuracy at the last step (`accuracy`, eval.accuracy_reward); the load average before
and after (the machine may be shared: figures under load say so). Targets (issue 63): split k=1
>= 1.3x split k=0's steps/s, the slower side busy >= 0.9 at k=1, the demo's accuracy at k=1 >= 0.9.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

WARMUP = 5  # steps left out of the rate: the first compiles, the next ones fill the caches
CONFIGS = [("colocated", 0), ("split", 0), ("split", 1), ("split", 2)]
WORKLOADS = {
    "demo": {"steps": 600, "model": None},
    "larger": {"steps": 40, "model": {"preset": "small"}},
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config(workload: str, layout: str, k: int, steps: int, root: str) -> dict:
    from grpo_core.config.run import DEFAULT

    cfg = copy.deepcopy(DEFAULT)
    cfg["run_name"] = f"{workload}-{layout}-k{k}"
    cfg["storage"] = {"root": root}
    if WORKLOADS[workload]["model"]:
        cfg["model"] = {**cfg["model"], **WORKLOADS[workload]["model"]}
    cfg["train"] = {**cfg["train"], "num_steps": steps, "max_staleness": k, "rollout": {"layout": layout}}
    if layout == "split":
        cfg["train"]["rollout"]["devices"] = 1  # the rollout one core, the learner the rest
    cfg["eval"] = {**cfg["eval"], "num_samples": 1}  # the greedy accuracy is the figure
    return cfg


def prepare(cfg: dict) -> str:
    from grpo_core.config.run import RunConfig
    from grpo_core.data.prepare import prepare_dataset
    from grpo_core.data.tokenizer import make_tokenizer
    from grpo_core.store.runs import init_run_root

    run_cfg = RunConfig.from_dict(cfg)
    run = init_run_root(run_cfg)
    prepare_dataset(run_cfg.data, make_tokenizer(run_cfg), run, run_cfg.tokenizer_id)
    return run_cfg.run_url


def measure(workload: str, layout: str, k: int, steps: int, root: str) -> dict:
    """One run of the worker; its rate, both sides' busy fractions and its accuracy."""
    url = prepare(config(workload, layout, k, steps, root))
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_core.stages.worker", "train", "--until-step", str(steps)]
        + ["--then-eval", str(steps), "--root", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    arrived, rows, accuracy = [], [], None
    for line in proc.stdout:
        e = json.loads(line)
        if e["event"] == "step":
            arrived.append(time.perf_counter())
        elif e["event"] == "eval":
            accuracy = e["accuracy"]
    err = proc.stderr.read()
    if proc.wait() != 0:
        raise RuntimeError(f"{workload} {layout} k={k}: the worker exited with {proc.returncode}: {err[-3000:]}")
    from grpo_core.store.root import RunRoot

    rows = sorted(RunRoot(url).read_metrics(), key=lambda r: r["step"])[WARMUP:]
    window = arrived[-1] - arrived[WARMUP - 1]  # from the end of the last warm-up step to the end of the last
    sides = busy(rows, window, layout, k)
    slow = max(sides, key=sides.get)
    return {
        "workload": workload,
        "layout": layout,
        "max_staleness": k,
        "steps": steps,
        "steps_per_s": len(rows) / window,
        "slow_side": slow,
        "slow_side_busy": sides[slow],
        "learner_busy": sides["learner"],
        "rollout_busy": sides["rollout"],
        "staleness_mean": sum(r.get("async/staleness", 0.0) for r in rows) / len(rows),
        "accuracy": accuracy,
        "wall_s": time.perf_counter() - t0,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def busy(rows: list[dict], window: float, layout: str, k: int) -> dict[str, float]:
    """Each side's working seconds over the window, as a fraction of it. The rollout side draws
    the batch of step s + k during step s: the batches it drew in the window are the rows' from
    the k-th on (the first k it drew before; after the last step it has nothing left to draw)."""
    total = lambda key, rs=rows: sum(r.get(key, 0.0) for r in rs)
    if layout == "colocated" and k == 0:  # one process in turn: the step's own split
        rollout = total("time/rollout") + total("time/rewards")
        learner = sum(total(f"time/{p}") for p in ("update", "reference", "rescore", "sync"))
    else:
        rollout = total("async/rollout_busy_s", rows[k:])
        learner = window - total("async/learner_wait_s")
    return {"learner": learner / window, "rollout": rollout / window}


def table(runs: list[dict]) -> str:
    head = (
        f"{'workload':<8} {'layout':<10} {'k':>2} {'steps':>6} {'steps/s':>8} {'vs split0':>9} {'slow side':>9} "
        f"{'busy':>5} {'learner':>7} {'rollout':>7} {'acc':>5} {'wall s':>7} {'load':>10}"
    )
    out = [head]
    base = {r["workload"]: r["steps_per_s"] for r in runs if r["layout"] == "split" and r["max_staleness"] == 0}
    for r in runs:
        ratio = r["steps_per_s"] / base[r["workload"]] if r["workload"] in base else float("nan")
        acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.2f}"
        out.append(
            f"{r['workload']:<8} {r['layout']:<10} {r['max_staleness']:>2} {r['steps']:>6} {r['steps_per_s']:>8.2f} "
            f"{ratio:>8.2f}x {r['slow_side']:>9} {r['slow_side_busy']:>5.2f} {r['learner_busy']:>7.2f} "
            f"{r['rollout_busy']:>7.2f} {acc:>5} {r['wall_s']:>7.0f} {r['load_before']:>4.1f}->{r['load_after']:<4.1f}"
        )
    return "\n".join(out)


def verdicts(runs: list[dict]) -> list[str]:
    """The issue's targets, each said held or not, with the figures."""
    by = {(r["workload"], r["layout"], r["max_staleness"]): r for r in runs}
    out = []
    for w in WORKLOADS:
        s0, s1 = by.get((w, "split", 0)), by.get((w, "split", 1))
        if s0 is None or s1 is None:
            continue
        ratio = s1["steps_per_s"] / s0["steps_per_s"]
        out.append(
            f"{w}: split k=1 {ratio:.2f}x split k=0's steps/s (target >= 1.3): {'held' if ratio >= 1.3 else 'NOT held'}"
        )
        out.append(
            f"{w}: the slower side ({s1['slow_side']}) busy {s1['slow_side_busy']:.2f} at k=1 (target >= 0.9): "
            + ("held" if s1["slow_side_busy"] >= 0.9 else "NOT held")
        )
        if w == "demo" and s1["accuracy"] is not None:
            out.append(
                f"demo: held-out accuracy {s1['accuracy']:.2f} at k=1 after {s1['steps']} steps (target >= 0.9): "
                + ("held" if s1["accuracy"] >= 0.9 else "NOT held")
            )
        c0 = by.get((w, "colocated", 0))
        if c0 is not None:
            out.append(
                f"{w}: colocated k=0 (both cores, synchronous) {c0['steps_per_s']:.2f} steps/s, split k=1 "
                f"{s1['steps_per_s']:.2f} ({s1['steps_per_s'] / c0['steps_per_s']:.2f}x)"
            )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    ap.add_argument("--steps", type=int, help="steps of each run (default: 600 demo, 40 larger)")
    ap.add_argument("--json", help="write {'runs': [...]} here")
    args = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="grpo-bench-async-") as root:
        for w in WORKLOADS if args.workload == "all" else [args.workload]:
            for layout, k in CONFIGS:
                runs.append(measure(w, layout, k, args.steps or WORKLOADS[w]["steps"], root))
                print(table(runs[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}); load average when each run started")
    print(table(runs))
    print("\n".join(verdicts(runs)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "cores": os.cpu_count(), "warmup_steps": WARMUP}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
