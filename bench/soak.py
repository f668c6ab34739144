"""Kill soak: SIGKILL the training worker and `grpo run` itself at random moments, resume each
time, and check the run ends with the same final parameters as an uninterrupted one.

    python -m bench.soak [--worker-kills 20] [--cli-kills 5] [--seed 0]

Three runs of the demo's config (local storage, the CLI's embedded Prefect server):
1. baseline: `grpo run`, untouched;
2. worker kills: one `grpo run` whose training worker is SIGKILLed --worker-kills times, each at a
   random moment of its life (start-up, a step, a checkpoint being written); the pipeline's task
   retries resume it from the newest checkpoint;
3. CLI kills: `grpo run` SIGKILLed --cli-kills times at random moments and started again each
   time, then once more to the end. After each kill nothing of it may stay running (its Prefect
   server and its workers stop with it).

Equal means the exported model.safetensors are byte-identical and the metrics rows hold the same
steps, each once. Prints a table; exits 1 when a run differs or a process outlives its CLI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

NUM_STEPS = 1200  # the demo's config, 4 epochs of 300 steps, with room for the kills' retries
SETTINGS = [
    f"train.num_steps={NUM_STEPS}",
    "pipeline.checkpoint_every=20",
    "pipeline.retries=40",
    "pipeline.retry_delay_s=0",
    "pipeline.flow_retries=0",
]


def grpo_run(root: Path, name: str) -> subprocess.Popen:
    argv = [
        str(Path(sys.executable).with_name("grpo")),
        "run",
        "--set",
        f"storage.root={root}",
        "--set",
        f"run_name={name}",
    ]
    for s in SETTINGS:
        argv += ["--set", s]
    log = open(root / f"{name}.log", "ab")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def train_workers(cli: psutil.Process) -> list[psutil.Process]:
    out = []
    for p in _descendants(cli):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if "grpo_core.stages.worker" in cmd and "train" in cmd:
            out.append(p)
    return out


def _descendants(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def steps_done(run: Path) -> int:
    steps = set()
    for f in (run / "metrics").glob("*.jsonl"):
        steps.update(json.loads(line)["step"] for line in f.read_text().splitlines() if line.strip())
    return len(steps)


def outcome(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    rows = []
    for f in sorted((run / "metrics").glob("*.jsonl")):
        rows += [json.loads(line)["step"] for line in f.read_text().splitlines() if line.strip()]
    st = summary.get("steps")
    digest = None
    if summary.get("export_uri"):
        digest = hashlib.sha256((Path(summary["export_uri"]) / "model.safetensors").read_bytes()).hexdigest()
    return {"status": summary["status"], "steps": st, "distinct_rows": len(set(rows)), "params": digest}


def soak_worker(root: Path, kills: int, rng: random.Random) -> tuple[int, int, int]:
    """(kills done, kills after the worker's first new metric row, retries of the CLI's run)."""
    cli = grpo_run(root, "worker-kills")
    proc, done, mid, seen = psutil.Process(cli.pid), 0, 0, set()
    while cli.poll() is None and done < kills:
        workers = [w for w in train_workers(proc) if w.pid not in seen]
        if not workers:
            time.sleep(0.2)
            continue
        w = workers[0]
        seen.add(w.pid)
        before = steps_done(root / "worker-kills")
        time.sleep(rng.uniform(1.0, 7.0))  # start-up (JAX, compile) takes ~3 s of it, an epoch ~12 s
        try:
            w.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            continue  # it ended first (its epoch was done)
        done += 1
        mid += steps_done(root / "worker-kills") > before
    rc = cli.wait()
    if rc != 0:
        raise SystemExit(f"the worker-kill run failed (exit {rc}): see {root / 'worker-kills.log'}")
    return done, mid, 0


def soak_cli(root: Path, kills: int, rng: random.Random) -> tuple[int, int]:
    """(kills done, processes found running after a kill)."""
    leftovers = 0
    for _ in range(kills):
        cli = grpo_run(root, "cli-kills")
        proc = psutil.Process(cli.pid)
        time.sleep(rng.uniform(15.0, 60.0))  # the embedded server starts in 10-35 s here
        family = [proc, *_descendants(proc)]
        os.kill(cli.pid, signal.SIGKILL)
        cli.wait()
        _, alive = psutil.wait_procs(family, timeout=30)
        leftovers += len([p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE])
        for p in alive:  # stop what outlived it, by its own handle, and report it
            p.kill()
    cli = grpo_run(root, "cli-kills")
    if cli.wait() != 0:
        raise SystemExit(f"the resumed CLI-kill run failed: see {root / 'cli-kills.log'}")
    return kills, leftovers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak")
    ap.add_argument("--worker-kills", type=int, default=20)
    ap.add_argument("--cli-kills", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", default=None, help="where the three runs go (default: a temporary folder)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    root = Path(args.root or tempfile.mkdtemp(prefix="grpo-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    t = time.perf_counter()
    base = grpo_run(root, "baseline")
    if base.wait() != 0:
        raise SystemExit(f"the baseline run failed: see {root / 'baseline.log'}")
    t_base = time.perf_counter() - t
    t = time.perf_counter()
    w_done, w_mid, _ = soak_worker(root, args.worker_kills, rng)
    t_worker = time.perf_counter() - t
    t = time.perf_counter()
    c_done, leftovers = soak_cli(root, args.cli_kills, rng)
    t_cli = time.perf_counter() - t
    want = outcome(root / "baseline")
    rows = [
        ("baseline", "-", want, t_base),
        (
            "worker SIGKILL",
            f"{w_done} ({w_mid} mid-training)",
            outcome(root / "worker-kills"),
            t_worker,
        ),
        ("grpo run SIGKILL", f"{c_done} ({leftovers} left running)", outcome(root / "cli-kills"), t_cli),
    ]
    print(f"{'run':18} {'kills':26} {'status':10} {'steps':>5} {'rows':>5} {'params = baseline':>18} {'wall s':>7}")
    ok = leftovers == 0
    for name, kills, o, secs in rows:
        same = o["params"] == want["params"] and o["params"] is not None
        ok &= same and o["status"] == "completed" and o["distinct_rows"] == NUM_STEPS
        print(
            f"{name:18} {kills:26} {o['status']:10} {o['steps']!s:>5} {o['distinct_rows']:>5} "
            f"{('yes' if same else 'NO'):>18} {secs:7.0f}"
        )
    print(f"runs in {root}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
