"""Stopping `grpo run` the ways users and schedulers do: Ctrl-C (SIGINT), SIGTERM, a second Ctrl-C,
and kill -9 of the CLI. Each ends in seconds with nothing left running; a graceful stop saves a
checkpoint where the worker stopped and the same command resumes from it.

The CLI runs as a real subprocess. Against the session's Prefect server (PREFECT_API_URL) or, for
kill -9, with no server configured, so that it starts its own (flows.local_server)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.usefixtures("prefect_server")

# tiny preset, 60-120 ms a step here: the 100 steps after the first checkpoint (step 20) take
# 6-12 s, long enough to interrupt, which the CLI does in well under a second; and the resume
# trains only those (400 steps cost ~40 s more of the suite)
STEPS = 120
ARGS = ["--set", f"train.num_steps={STEPS}", "--set", "pipeline.checkpoint_every=20", "--set", "pipeline.epochs=1"]


def _env(api_url: str | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    else:
        env.pop("PREFECT_API_URL", None)
    return env


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def _start(tmp_path, api_url: str | None, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flows.cli", "run", "--set", f"storage.root={tmp_path}/runs", *ARGS, *extra]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(api_url), cwd=tmp_path
    )


def _descendants(pid: int) -> set[int]:
    """Every process whose parent chain reaches `pid` (from /proc: sessions of their own included)."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p}
        out |= kids
        todo += list(kids)
    return out


def _alive(pids: set[int]) -> set[int]:
    left = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    left.add(p)
        except OSError:
            pass
    return left


def _read_until(proc: subprocess.Popen, text: str, timeout_s: float = 240) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"never saw {text!r}:\n{''.join(lines[-30:])}")


def _finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str, float]:
    t = time.monotonic()
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out, time.monotonic() - t


def _run_dir(tmp_path) -> str:
    (name,) = os.listdir(tmp_path / "runs")
    return str(tmp_path / "runs" / name)


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)], ids=["ctrl-c", "sigterm"]
)
def test_interrupt_stops_the_worker_saves_and_resumes(tmp_path, sig):
    proc = _start(tmp_path, _api_url())
    _read_until(proc, "checkpoint ")
    workers = _descendants(proc.pid)
    assert workers, "no worker process under the CLI"
    proc.send_signal(sig)
    rc, out, seconds = _finish(proc, timeout_s=90)  # before the fix: ~7.5 minutes, then "ConnectError"
    assert rc == 128 + sig, out[-3000:]
    assert "run interrupted" in out, out[-3000:]
    assert not _alive(workers), "a worker outlived the CLI"
    run = _run_dir(tmp_path)
    summary = json.load(open(f"{run}/summary.json"))
    assert summary["status"] == "interrupted", summary
    saved = max(int(n) for n in os.listdir(f"{run}/checkpoints") if n.isdigit())
    assert saved % 20 != 0 or saved == summary["steps"], "the stop saved a checkpoint where it stopped"
    if sig == signal.SIGTERM:
        return  # the resume below is the same whichever signal stopped the run (the Ctrl-C case runs it)
    assert f"resumes from checkpoint {saved}" in out, out[-3000:]

    # the same command resumes from that checkpoint: no step run twice, none missing
    proc = _start(tmp_path, _api_url())
    rc, out, _ = _finish(proc, timeout_s=300)
    assert rc == 0, out[-3000:]
    assert "resumed" in out or f"from step {saved}" in out, out[-3000:]
    rows = [json.loads(line) for f in sorted(os.listdir(f"{run}/metrics")) for line in open(f"{run}/metrics/{f}")]
    steps = [r["step"] for r in rows]
    assert sorted(steps) == list(range(STEPS)), steps[-20:]


def _train_then_lose_the_api(tmp_path, **env: str) -> tuple[subprocess.Popen, set[int], str]:
    """`grpo run` against a `prefect server start` of its own, which is stopped once the run has
    written its first checkpoint: (the CLI's process, its workers, the API's URL)."""
    from tests.prefect_server import _stop, client_env, start_server

    (home := tmp_path / "prefect").mkdir()
    server, url = start_server(home)
    try:
        env = dict(client_env(home, url), PYTHONUNBUFFERED="1", **env)
        args = ["--set", "train.num_steps=2000", "--set", "pipeline.checkpoint_every=20", "--set", "pipeline.epochs=1"]
        cmd = [sys.executable, "-m", "flows.cli", "run", "--set", f"storage.root={tmp_path}/runs", *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
        try:
            _read_until(proc, "checkpoint ")
            workers = _descendants(proc.pid)
            assert workers, "no worker process under the CLI"
        except BaseException:  # the run never got going: stop it (its workers follow it)
            proc.kill()
            proc.wait()
            raise
    finally:
        _stop(server)
    return proc, workers, url


@pytest.mark.slow
def test_a_stop_ends_when_the_prefect_api_is_gone(tmp_path):
    """Ctrl-C after the run's Prefect server went away (a network cut, a server stopped). Before,
    the CLI spent many minutes in Prefect's client retries (about a minute a call) and had to be
    killed. Now its workers stop and save as in any stop, and after GRPO_STOP_REPORT_S the CLI
    exits saying why, nothing left running, the checkpoint kept for the same command."""
    proc, workers, _ = _train_then_lose_the_api(tmp_path, GRPO_STOP_REPORT_S="10")
    proc.send_signal(signal.SIGINT)
    rc, out, seconds = _finish(proc, timeout_s=150)
    assert rc == 130, out[-3000:]
    assert "is the Prefect API reachable?" in out and "the same command resumes from it" in out, out[-3000:]
    assert not _alive(workers), "a worker outlived the CLI"
    run = _run_dir(tmp_path)
    assert [n for n in os.listdir(f"{run}/checkpoints") if n.isdigit()], "no checkpoint kept"


@pytest.mark.slow
def test_a_run_whose_prefect_api_goes_away_says_so(tmp_path):
    """The run's Prefect server goes away mid-training, nobody stops the run: it fails once
    Prefect's client gives up (no client retries here, to keep the test short), saying that the
    API did not answer (before: "run failed: ConnectError: [Errno 111] Connection refused", after a
    log line that called it cancelled), with its checkpoints kept and nothing left running, and
    exits then."""
    proc, workers, url = _train_then_lose_the_api(tmp_path, PREFECT_CLIENT_MAX_RETRIES="0")
    rc, out, seconds = _finish(proc, timeout_s=240)
    assert rc == 1, out[-3000:]
    assert f"run failed: the Prefect API at {url} did not answer" in out, out[-3000:]
    assert "Finished: cancelled" not in out, out[-3000:]
    # it exits once it has said so, not after Prefect's services tried each event they held for the
    # gone API, seconds apart ("Still processing items: 6 items remaining..." and 43 s more, before)
    assert "Still processing items" not in out, out[-3000:]
    assert not _alive(workers), "a worker outlived the CLI"
    run = _run_dir(tmp_path)
    assert [n for n in os.listdir(f"{run}/checkpoints") if n.isdigit()], "no checkpoint kept"


def test_second_ctrl_c_exits_at_once(tmp_path):
    proc = _start(tmp_path, _api_url(), "--set", "train.sampling.max_new_tokens=64")
    _read_until(proc, "step ")
    workers = _descendants(proc.pid)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    rc, out, seconds = _finish(proc, timeout_s=30)
    assert rc == 130 and "exiting now" in out, out[-3000:]
    deadline = time.monotonic() + 10
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(workers), "a worker outlived a second Ctrl-C"


@pytest.mark.slow
def test_kill_9_of_the_cli_leaves_nothing_running(tmp_path):
    """No PREFECT_API_URL: the CLI starts its own server. kill -9 of the CLI takes it, and the
    training worker, with it (before: the server ran on, ~200 MB each, one per kill)."""
    proc = _start(tmp_path, None)
    lines = _read_until(proc, "checkpoint ")
    assert any("Prefect server for this run" in line for line in lines), "".join(lines)
    children = _descendants(proc.pid)
    assert len(children) >= 2, children  # the server and the worker
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while _alive(children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(children), f"left running after kill -9 of the CLI: {_alive(children)}"
    # the worker stopped as a Ctrl-C stops it: at its next step boundary, with a checkpoint there
    # (issue 65 item 7: before, its next line's BrokenPipeError ended it without one)
    [run] = [p for p in (tmp_path / "runs").iterdir() if not p.name.startswith("_")]
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] > 20, steps  # past the checkpoint the CLI had logged when it was killed


def test_second_ctrl_c_exits_even_when_nobody_reads_the_output(tmp_path):
    """The parent that read the CLI's output is gone (a closed pipe): the handler's message fails
    to print, and the second Ctrl-C must still exit with 130 (before: 1, from BrokenPipeError)."""
    proc = _start(tmp_path, _api_url(), "--set", "train.sampling.max_new_tokens=64")
    _read_until(proc, "step ")
    workers = _descendants(proc.pid)
    proc.stdout.close()
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    deadline = time.monotonic() + 10
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(workers), "a worker outlived a second Ctrl-C"
