"""The faults users cause, tried through `grpo run` as a user would, one row each:

    python -m bench.fault_matrix [--only NAME[,NAME]]

Each case runs the CLI (tiny preset, a local run root of its own, one Prefect server for all of
them, started and stopped here) and prints what happened: exit code, seconds to the end, and the
line that says why. A case passes when the run ends the way docs/DESIGN.md and the docs (docs/)
promise (the expectation is in the table); the script exits 1 when one does not.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

STEPS = ["--set", "train.num_steps=300", "--set", "pipeline.checkpoint_every=20", "--set", "pipeline.epochs=2"]
FAST = ["--set", "pipeline.retry_delay_s=0", "--set", "pipeline.export=false"]


class Case:
    def __init__(self, base: Path, name: str):
        self.dir = base / name
        self.dir.mkdir(parents=True)
        self.root = self.dir / "runs"

    def start(self, *args: str, prefix: tuple[str, ...] = (), env: dict | None = None) -> subprocess.Popen:
        grpo = str(Path(sys.executable).with_name("grpo"))
        argv = [*prefix, grpo, "run", "--set", f"storage.root={self.root}", "--set", "run_name=r", *STEPS, *FAST]
        return subprocess.Popen(
            [*argv, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=self.dir,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    def run(self, *args: str, **kw) -> tuple[int, str, float]:
        t = time.monotonic()
        p = self.start(*args, **kw)
        out, _ = p.communicate(timeout=900)
        return p.returncode, out, time.monotonic() - t

    @property
    def run_dir(self) -> Path:
        return self.root / "r"

    def summary(self) -> dict:
        f = self.run_dir / "summary.json"
        return json.loads(f.read_text()) if f.exists() else {}


def read_until(p: subprocess.Popen, text: str, timeout_s: float = 300) -> str:
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise RuntimeError(f"never saw {text!r}: {''.join(seen[-5:])}")


def family(p: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(p.pid).children(recursive=True)
    except psutil.Error:
        return []


def left_running(procs: list[psutil.Process], wait_s: float = 30) -> int:
    _, alive = psutil.wait_procs(procs, timeout=wait_s)
    alive = [a for a in alive if a.is_running() and a.status() != psutil.STATUS_ZOMBIE]
    for a in alive:  # stopped by its own handle, and counted
        a.kill()
    return len(alive)


def why(out: str, *keys: str) -> str:
    """The output's line that says why (its first line holding one of `keys`), shortened."""
    for line in out.splitlines():
        if any(k in line for k in keys):
            text = line.split(" - ", 1)[-1].strip()
            return text if len(text) < 150 else text[:147] + "..."
    return out.strip().splitlines()[-1][:150] if out.strip() else ""


def flow_attempts(out: str) -> int:
    return out.count("Task run 'init-run") // 2 or 1  # each attempt logs init-run's start and end


# -- cases: each returns (ok, outcome) ---------------------------------------------------------


def signal_case(c: Case, sig: int, twice: bool = False) -> tuple[bool, str]:
    p = c.start()
    read_until(p, "checkpoint ")
    kids = family(p)
    t = time.monotonic()
    p.send_signal(sig)
    if twice:
        time.sleep(0.3)
        p.send_signal(sig)
    out, _ = p.communicate(timeout=300)
    secs, left = time.monotonic() - t, left_running(kids)
    status = c.summary().get("status")
    want_status = "interrupted" if not twice else status
    ok = p.returncode == 128 + sig and left == 0 and secs < 30 and status == want_status
    return ok, f"exit {p.returncode} in {secs:.1f} s, status {status}, {left} left running"


def kill9_cli(c: Case) -> tuple[bool, str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the CLI starts its own server
    p = subprocess.Popen(
        [str(Path(sys.executable).with_name("grpo")), "run", "--set", f"storage.root={c.root}", *STEPS, *FAST],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=c.dir,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )
    read_until(p, "checkpoint ")
    kids = family(p)
    p.kill()
    p.wait()
    left = left_running(kids)
    return left == 0, f"{len(kids)} processes under the CLI, {left} left running 30 s after kill -9"


def corrupt_checkpoint(c: Case) -> tuple[bool, str]:
    p = c.start()
    read_until(p, "checkpoint ")
    read_until(p, "checkpoint ")
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=120)
    steps = sorted(int(n) for n in os.listdir(c.run_dir / "checkpoints") if n.isdigit())
    newest = c.run_dir / "checkpoints" / str(steps[-1])
    victim = max((f for f in newest.rglob("*") if f.is_file() and "state" in f.parts), key=lambda f: f.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    rc, out, secs = c.run()
    aside = list((c.run_dir / "checkpoints" / "_set_aside").glob("*")) if rc == 0 else []
    ok = rc == 0 and len(aside) == 1 and c.summary().get("steps") == 300
    return ok, f"exit {rc} in {secs:.0f} s; {why(out, 'set aside')}"


HANG = """\
import time


def hang(prompts, completions, **columns):
    time.sleep(100000)
    return [0.0] * len(completions)
"""


def hung_reward(c: Case) -> tuple[bool, str]:
    (c.dir / "hang.py").write_text(HANG)
    (c.dir / "cfg.yaml").write_text(
        f"rewards: [{{function: '{c.dir}/hang.py:hang'}}]\ntrain: {{reward_timeout_s: 10}}\n"
    )
    rc, out, secs = c.run("--config", str(c.dir / "cfg.yaml"))
    attempts = out.count("exited with code")
    ok = rc != 0 and secs < 120 and "'hang'" in out and attempts <= 1
    return ok, f"exit {rc} in {secs:.0f} s, {attempts} worker attempt(s); {why(out, 'did not return', 'hang')}"


def two_runs(c: Case) -> tuple[bool, str]:
    first = c.start()
    read_until(first, "step ")
    rc2, out2, secs2 = c.run()
    out1, _ = first.communicate(timeout=600)
    ok = rc2 != 0 and secs2 < 60 and first.returncode == 0 and c.summary().get("steps") == 300
    return ok, f"second: exit {rc2} in {secs2:.0f} s ({why(out2, 'in use', 'owned')}); first: exit {first.returncode}"


def learns_nothing(c: Case) -> tuple[bool, str]:
    """math_answer on data with no ground_truth column (data.format plain): no row can be scored."""
    rows = [json.dumps({"question": f"{i}+{i}", "answer": f"so #### {2 * i}"}) for i in range(64)]
    (c.dir / "q.jsonl").write_text("\n".join(rows) + "\n")
    cfg = f"data: {{source: '{c.dir}/q.jsonl', format: plain, prompt_column: question}}\n"
    cfg += (
        "rewards: [{function: math_answer}]\neval: {rewards: [{function: math_answer}], accuracy_reward: math_answer}\n"
    )
    (c.dir / "cfg.yaml").write_text(cfg)
    rc, out, secs = c.run("--config", str(c.dir / "cfg.yaml"))
    ok = rc != 0 and secs < 90 and "train-epoch" not in out
    return ok, f"exit {rc} in {secs:.0f} s, before training; {why(out, 'scored', 'ground_truth')}"


def config_error(c: Case) -> tuple[bool, str]:
    rc, out, secs = c.run("--set", "train.grpo.num_generations=1")
    n = flow_attempts(out)
    return rc != 0 and n == 1, f"exit {rc} in {secs:.0f} s, {n} flow attempt(s); {why(out, 'num_generations')}"


def bad_reward_file(c: Case) -> tuple[bool, str]:
    (c.dir / "cfg.yaml").write_text(f"rewards: [{{function: '{c.dir}/nope.py:score'}}]\n")
    rc, out, secs = c.run("--config", str(c.dir / "cfg.yaml"))
    ok = rc != 0 and "train-epoch" not in out and flow_attempts(out) == 1
    return ok, f"exit {rc} in {secs:.0f} s, at init; {why(out, 'does not exist')}"


NO_NETWORK = ("unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"')  # loopback only


def gcs_no_network(c: Case) -> tuple[bool, str]:
    env = {"PREFECT_API_URL": ""}  # inside its own network namespace the shared server is out of reach
    rc, out, secs = c.run("--set", "storage.root=gs://grpo-bench/runs", prefix=NO_NETWORK, env=env)
    ok = rc != 0 and secs < 90 and "storage.root" in out
    return ok, f"exit {rc} in {secs:.0f} s; {why(out, 'storage.root')}"


def empty_csv_values(c: Case) -> tuple[bool, str]:
    rows = ["question,answer", ",7", "2+2,", *[f"{i}+1,{i + 1}" for i in range(60)]]
    (c.dir / "q.csv").write_text("\n".join(rows) + "\n")
    rc, out, secs = c.run(
        "--set", f"data.source={c.dir}/q.csv", "--set", "data.prompt_column=question", "--set", "train.num_steps=4"
    )
    manifest = next(c.run_dir.glob("data/*/manifest.json"), None)
    stats = json.loads(manifest.read_text()) if manifest else {}
    shown = {k: v for k, v in stats.items() if k.startswith("dropped") or "empty" in k}
    ok = rc == 0 and stats.get("dropped_too_long") == 0 and "empty" in json.dumps(shown)
    return ok, f"exit {rc}; {json.dumps(shown)}"


def deleted_marker(c: Case) -> tuple[bool, str]:
    rc, _, _ = c.run()
    before = json.loads((c.run_dir / "stages/train-epoch-0/_SUCCESS").read_text())
    timing = c.summary().get("timing")
    (c.run_dir / "stages/train-epoch-0/_SUCCESS").unlink()
    rc2, out, secs = c.run()
    after = json.loads((c.run_dir / "stages/train-epoch-0/_SUCCESS").read_text())
    same = (after["step"], after["reward"]) == (before["step"], before["reward"])
    ok = rc == rc2 == 0 and same and c.summary().get("timing") == timing
    return ok, (
        f"marker step {before['step']} -> {after['step']}, reward {before['reward']} -> {after['reward']}; "
        f"summary timing kept: {c.summary().get('timing') == timing}; re-run {secs:.0f} s"
    )


SHORT = ["--set", "train.num_steps=40", "--set", "pipeline.epochs=1"]


def run_name_dotdot(c: Case) -> tuple[bool, str]:
    rc, out, secs = c.run("--set", "run_name=..")
    wrote = sorted(p.name for p in c.dir.iterdir() if p.name != "runs")
    ok = rc == 2 and "run_name must be a single folder name" in out and not wrote and not c.root.exists()
    return ok, f"exit {rc} in {secs:.0f} s, nothing written; {why(out, 'run_name')}"


def export_outside(c: Case) -> tuple[bool, str]:
    grpo = str(Path(sys.executable).with_name("grpo"))
    out = subprocess.run([grpo, "export", "../../etc"], capture_output=True, text=True, cwd=c.dir, timeout=120)
    ok = out.returncode == 2 and "is not a run" in out.stderr
    return ok, f"exit {out.returncode}; {why(out.stderr, 'is not a run')}"


def cut_metrics_line(c: Case) -> tuple[bool, str]:
    rc, _, _ = c.run(*SHORT)
    shard = sorted((c.run_dir / "metrics").glob("*.jsonl"))[-1]
    shard.write_bytes(shard.read_bytes()[:-20])
    grpo = str(Path(sys.executable).with_name("grpo"))
    st = subprocess.run([grpo, "status", str(c.run_dir)], capture_output=True, text=True, timeout=120)
    rc2, out, secs = c.run(*SHORT)
    ok = rc == rc2 == st.returncode == 0 and shard.name in st.stderr and "Traceback" not in st.stdout + st.stderr
    return ok, f"status exit {st.returncode} ({why(st.stderr, 'damaged')}); re-run exit {rc2} in {secs:.0f} s"


def cut_config_json(c: Case) -> tuple[bool, str]:
    c.run(*SHORT)
    config = c.run_dir / "config.json"
    config.write_bytes(config.read_bytes()[:200])
    rc, out, secs = c.run(*SHORT)
    n = flow_attempts(out)
    ok = rc != 0 and n == 1 and "config.json is damaged" in out
    return ok, f"exit {rc} in {secs:.0f} s, {n} flow attempt(s); {why(out, 'is damaged')}"


def immutable_checkpoints(c: Case) -> tuple[bool, str]:
    p = c.start()
    read_until(p, "checkpoint ")
    folder = c.run_dir / "checkpoints"
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        p.kill()
        p.communicate()
        return True, "skipped: chattr +i is not available here"
    t = time.monotonic()
    try:
        out, _ = p.communicate(timeout=600)
    finally:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    secs = time.monotonic() - t
    ok = p.returncode != 0 and secs < 120 and "cannot write checkpoint" in out and flow_attempts(out) == 1
    return ok, f"exit {p.returncode} {secs:.0f} s after the folder locked; {why(out, 'cannot write checkpoint')}"


def stale_temp_files(c: Case) -> tuple[bool, str]:
    c.run(*SHORT)
    old = time.time() - 3600
    stale = [c.run_dir / "config.json.tmp-0a1b2c3d", c.run_dir / "metrics" / "x.jsonl.tmp-deadbeef"]
    for f in stale:
        f.write_bytes(b"")
        os.utime(f, (old, old))
    rc, out, secs = c.run(*SHORT)
    left = sorted(str(f.relative_to(c.root)) for f in c.root.rglob("*.tmp-*"))
    return rc == 0 and not left, f"re-run exit {rc} in {secs:.0f} s; temporary files left: {left or 'none'}"


def init_from_deleted(c: Case) -> tuple[bool, str]:
    """The run model.init_from names is deleted in the middle of a continual run, then the run is
    run again: it evaluates and resumes from its own copy (start/)."""
    import shutil

    rc0, _, _ = c.run(*SHORT, "--set", "run_name=src")
    p = c.start("--set", "train.num_steps=60", "--set", "model.init_from=src")
    read_until(p, "checkpoint ")
    shutil.rmtree(c.root / "src")
    out, _ = p.communicate(timeout=900)
    rc2, again, secs = c.run("--set", "train.num_steps=60", "--set", "model.init_from=src")
    ok = rc0 == p.returncode == rc2 == 0 and "own copy" in again and c.summary().get("status") == "completed"
    said = why(again, "own copy")
    return ok, f"exit {p.returncode} after the source went; re-run exit {rc2} in {secs:.0f} s ({said})"


CASES = {
    "ctrl-c": ("exit 130 in seconds, status interrupted", lambda c: signal_case(c, signal.SIGINT)),
    "sigterm": ("exit 143 in seconds, status interrupted", lambda c: signal_case(c, signal.SIGTERM)),
    "ctrl-c twice": ("exit 130 at once, workers killed", lambda c: signal_case(c, signal.SIGINT, twice=True)),
    "kill -9 grpo run": ("server and worker stop with it", kill9_cli),
    "corrupt checkpoint": ("set aside, resumes from an older one", corrupt_checkpoint),
    "hung reward": ("stops in reward_timeout_s, names it, no retry", hung_reward),
    "two runs one root": ("second refused at once, first completes", two_runs),
    "learns nothing": ("fails at data preparation", learns_nothing),
    "config error": ("fails once, names the field", config_error),
    "bad reward file": ("fails at init, once", bad_reward_file),
    "gs:// no network": ("fails in seconds naming storage.root", gcs_no_network),
    "empty CSV values": ("counted by column, not as too long", empty_csv_values),
    "deleted marker": ("rebuilt at the epoch's end; timing kept", deleted_marker),
    "run_name ..": ("refused naming run_name, nothing written", run_name_dotdot),
    "export ../../etc": ("refused: not a run, no worker", export_outside),
    "cut metrics line": ("status warns naming the shard; re-run ok", cut_metrics_line),
    "cut config.json": ("fails once naming config.json", cut_config_json),
    "locked checkpoints": ("fails in seconds: cannot write checkpoint", immutable_checkpoints),
    "stale temp files": ("a re-run removes them", stale_temp_files),
    "init_from deleted": ("the run goes on from its copy of the start", init_from_deleted),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fault_matrix")
    ap.add_argument("--only", default="", help="comma-separated case names")
    args = ap.parse_args(argv)
    names = [n for n in CASES if not args.only or n in args.only.split(",")]
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.local_server import embedded_server

    base = Path(tempfile.mkdtemp(prefix="grpo-faults-"))
    failed = 0
    print(f"{'case':20} {'expected':46} {'ok':3} outcome")
    with embedded_server() as url:
        if url:
            os.environ["PREFECT_API_URL"] = url
        for name in names:
            expected, fn = CASES[name]
            try:
                ok, outcome = fn(Case(base, name.replace(" ", "-").replace("/", "").replace(":", "")))
            except Exception as exc:  # noqa: BLE001 - a case that breaks is a failed row, not the end of the table
                ok, outcome = False, f"{type(exc).__name__}: {exc}"[:200]
            failed += not ok
            print(f"{name:20} {expected:46} {'yes' if ok else 'NO':3} {textwrap.shorten(outcome, 160)}", flush=True)
    print(f"{len(names) - failed}/{len(names)} as expected; runs in {base}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
