"""A run on gs:// through the faults real buckets have: fake-gcs-server (from the dev install's
PyPI wheel) on 127.0.0.1 behind tests.gcs.GcsProxy, which answers 503 or 429 or drops the
connection in the middle of an upload on a share of the requests (each retried by gcsfs or
TensorStore with backoff).

    python -m bench.gcs_faults [--steps 40] [--epochs 2] [--error-rate 0.1]

Three two-epoch runs of the same config, one after another, each `grpo run` as a user types it:
1. clean: no fault injected (the baseline);
2. faults: --error-rate of the requests fail;
3. faults + kill: the same, and the training worker is SIGKILLed once its first checkpoint is on
   the bucket; the task's retry resumes it from there.

Equal means the exported model.safetensors are byte-identical to the clean run's, the metrics
hold every step once, and the summary, `grpo status` and the evaluations name the last step.
Prints a table; exits 1 when a run differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.gcs import BUCKET, FakeGcsServer, GcsProxy, env_for


def grpo(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    exe = str(Path(sys.executable).with_name("grpo"))
    out = open(log, "ab")
    return subprocess.Popen([exe, *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def settings(root: str, name: str, steps: int, epochs: int) -> list[str]:
    out = []
    for s in (
        f"storage.root={root}",
        f"run_name={name}",
        f"train.num_steps={steps}",
        f"pipeline.epochs={epochs}",
        "pipeline.retry_delay_s=0",
        "pipeline.flow_retries=0",
    ):
        out += ["--set", s]
    return out


def kill_first_trainer_after_checkpoint(cli: subprocess.Popen, run_url: str, env: dict[str, str]) -> bool:
    """SIGKILL the training worker once checkpoints/{k} is finalised on the bucket (read through
    gcsfs, as another process would); True if it was killed."""
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon", endpoint_url=env["STORAGE_EMULATOR_HOST"], skip_instance_cache=True)
    parent = psutil.Process(cli.pid)
    while cli.poll() is None:
        if fs.glob(f"{run_url}/checkpoints/*/commit_success.txt"):
            for p in parent.children(recursive=True):
                try:
                    if "grpo_core.stages.worker" in p.cmdline() and "train" in p.cmdline():
                        p.kill()
                        return True
                except psutil.Error:
                    continue
        time.sleep(0.2)
    return False


def outcome(run_url: str, env: dict[str, str]) -> dict:
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon", endpoint_url=env["STORAGE_EMULATOR_HOST"], skip_instance_cache=True)
    summary = json.loads(fs.cat_file(f"{run_url}/summary.json"))
    rows = []
    for f in sorted(fs.glob(f"{run_url}/metrics/*.jsonl")):
        rows += [json.loads(line)["step"] for line in fs.cat_file(f).decode().splitlines() if line.strip()]
    digest = None
    if summary.get("export_uri"):
        digest = hashlib.sha256(fs.cat_file(f"{summary['export_uri']}/model.safetensors")).hexdigest()[:12]
    evals = sorted(int(p.rsplit("/", 1)[-1][:-5]) for p in fs.glob(f"{run_url}/eval/*.json"))
    return {
        "status": summary["status"],
        "steps": summary.get("steps"),
        "rows": len(rows),
        "distinct": len(set(rows)),
        "evals": evals,
        "params": digest,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gcs_faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--error-rate", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    server = FakeGcsServer()
    server.start()
    proxy = GcsProxy(server.endpoint, seed=args.seed)
    proxy.start()
    env = {**os.environ, **env_for(proxy.endpoint), "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    logs = Path(server.data) / "logs"  # removed with the server's folder
    logs.mkdir()
    root = f"gs://{BUCKET}/bench"
    table, failed = [], False
    try:
        for name, rate, kill in (
            ("clean", 0.0, False),
            ("faults", args.error_rate, False),
            ("faults+kill", args.error_rate, True),
        ):
            proxy.reset()
            proxy.error_rate = rate
            t = time.perf_counter()
            cli = grpo(["run", *settings(root, name, args.steps, args.epochs)], env, logs / f"{name}.log")
            killed = kill_first_trainer_after_checkpoint(cli, f"{root}/{name}", env) if kill else False
            rc = cli.wait()
            wall = time.perf_counter() - t
            proxy.error_rate = 0.0
            st = subprocess.run(
                [str(Path(sys.executable).with_name("grpo")), "status", "--json", f"{root}/{name}"],
                env=env,
                capture_output=True,
                text=True,
            )
            status = json.loads(st.stdout) if st.returncode == 0 else {}
            out = outcome(f"{root}/{name}", env) if rc == 0 else {"status": f"exit {rc}"}
            injected = sum(proxy.injected.values())
            table.append((name, rate, killed, wall, injected, proxy.forwarded, out, status.get("steps_done")))
            if rc != 0:
                print((logs / f"{name}.log").read_text()[-3000:], file=sys.stderr)
    finally:
        proxy.stop()
        base = table[0][6].get("params") if table else None
        print(f"\n{args.steps} steps in {args.epochs} epochs on gs:// (fake-gcs-server behind the fault proxy)\n")
        print(
            f"{'run':<12} {'faults':>6} {'kill':>5} {'wall s':>7} {'x clean':>7} {'injected':>8} {'requests':>8} "
            f"{'status':<10} {'steps':>5} {'rows':>5} {'status steps':>12} {'evals':<12} {'export = clean':<14}"
        )
        for name, rate, killed, wall, injected, fwd, out, st_steps in table:
            same = out.get("params") is not None and out.get("params") == base
            ok = (
                out.get("status") == "completed"
                and out.get("steps") == args.steps
                and out.get("rows") == args.steps
                and out.get("distinct") == args.steps
                and st_steps == args.steps
                and same
            )
            failed |= not ok
            print(
                f"{name:<12} {rate:>6.0%} {str(killed):>5} {wall:>7.1f} {wall / table[0][3]:>7.2f} {injected:>8} "
                f"{fwd:>8} {out.get('status', '?'):<10} {str(out.get('steps')):>5} {str(out.get('rows')):>5} "
                f"{str(st_steps):>12} {','.join(map(str, out.get('evals', []))):<12} {str(same):<14}"
            )
        server.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
