"""Storage faults that used to read as crashes: a gs:// root with no network (minutes of gcsfs
retries, then a raw ClientConnectorDNSError), and a full disk (the worker exited 1, a crash, with
a cut-off traceback). Each now names storage.root, the cause and the fix, in seconds.

No network is a network namespace of the test's own (`unshare -n`: loopback only); a full disk a
2 MiB tmpfs in a mount namespace of its own (`unshare -m`). Where the machine does not allow
them, the tests skip."""

import json
import os
import subprocess
import sys
import time

import pytest


def _can(*argv: str) -> bool:
    try:
        return subprocess.run([*argv, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can("unshare", "-n"), reason="needs network namespaces (unshare -n)")
def test_gs_root_without_network_fails_in_seconds_naming_the_root(tmp_path):
    code = (
        "from grpo_core.config.run import RunConfig\n"
        "from grpo_core.store.runs import init_run_root\n"
        "cfg = RunConfig.from_dict({'storage': {'root': 'gs://grpo-bucket/runs'}, 'run_name': 'r'})\n"
        "init_run_root(cfg)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
    t = time.monotonic()
    out = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    seconds = time.monotonic() - t
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo_core.errors.StorageError: storage.root gs://grpo-bucket/runs/r:"), last
    assert "cannot resolve the storage host" in last and "GOOGLE_APPLICATION_CREDENTIALS" in last, last
    assert seconds < 60, f"{seconds:.0f} s to fail"  # before: about a minute per call, several calls


@pytest.mark.usefixtures("prefect_server")
def test_the_pipeline_checks_a_gs_root_before_its_first_storage_call(monkeypatch):
    """The run-root lease is the flow's first storage call: an unreachable gs:// root must fail
    there in seconds, naming storage.root (it took 100 s of gcsfs retries, then a raw error)."""
    from flows.pipeline import grpo_pipeline

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:1")  # nothing listens there: refused
    t = time.monotonic()
    state = grpo_pipeline.with_options(retries=0)(
        {"storage": {"root": "gs://grpo-bucket/runs"}, "run_name": "r"}, return_state=True
    )
    seconds = time.monotonic() - t
    assert state.is_failed()
    with pytest.raises(Exception, match=r"storage.root gs://grpo-bucket/runs: .*refused"):
        state.result()
    assert seconds < 30, f"{seconds:.0f} s to fail"


def _mount_ns() -> bool:
    try:
        cmd = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt && umount /mnt"]
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _mount_ns(), reason="needs mount namespaces and tmpfs (unshare -m, root)")
def test_full_disk_in_training_is_a_storage_error(tmp_path):
    """The run's data and config fit a 3 MiB disk; its checkpoints do not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    run = f"{disk}/r"
    code = (
        "import sys\n"
        "from grpo_core.config.run import RunConfig\n"
        "from grpo_core.store.runs import init_run_root\n"
        "from grpo_core.data.prepare import prepare_dataset\n"
        "from grpo_core.data.tokenizer import make_tokenizer\n"
        "from grpo_core.store.root import RunRoot\n"
        f"cfg = RunConfig.from_dict({{'storage': {{'root': '{disk}'}}, 'run_name': 'r',"
        " 'model': {'preset': 'tiny', 'hidden_size': 256, 'intermediate_size': 1024},"
        " 'train': {'num_steps': 4}, 'pipeline': {'checkpoint_every': 1}})\n"
        "init_run_root(cfg)\n"
        "prepare_dataset(cfg.data, make_tokenizer(cfg), RunRoot(cfg.run_url), cfg.tokenizer_id)\n"
    )
    script = (
        f'mount -t tmpfs -o size=3m tmpfs {disk} && {sys.executable} -c "$CODE" && '
        f"exec {sys.executable} -m grpo_core.stages.worker train --root {run} --until-step 4"
    )
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        capture_output=True,
        text=True,
        env=dict(os.environ, CODE=code, GRPO_COMPILATION_CACHE="0"),
        timeout=300,
    )
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    errors = [e for e in events if e.get("event") == "error"]
    assert out.returncode == 11, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])  # ExitCode.STORAGE_LASTING
    assert errors and errors[-1]["kind"] == "storage", errors
    assert f"storage.root {run}: no space left" in errors[-1]["message"], errors[-1]


def _can_make_immutable(tmp_path) -> bool:
    """Whether `chattr +i` makes a folder refuse new entries to this user (root included)."""
    probe = tmp_path / "immutable-probe"
    probe.mkdir()
    try:
        if subprocess.run(["chattr", "+i", str(probe)], capture_output=True, timeout=10).returncode != 0:
            return False
        try:
            (probe / "f").touch()
            return False
        except OSError:
            return True
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        subprocess.run(["chattr", "-i", str(probe)], capture_output=True, timeout=10)


IMMUTABLE_HOOK = """
import os, subprocess

def hook(point, *, step, root_url, **_):
    if point == "checkpoint" and step == 2:
        subprocess.run(["chattr", "+i", os.path.join(root_url, "checkpoints")], check=True)
"""


def test_a_checkpoints_folder_that_stops_taking_writes_fails_the_attempt_at_once(tmp_path):
    """issue 28: made immutable after the first checkpoint, the next save hung 300 s inside Orbax
    and the worker exited 1 (a crash, retried) with a TimeoutError; now exit 11 (a storage error a
    retry cannot fix) naming the checkpoint and the cause, well within the subprocess's limit
    (before: 300 s per attempt)."""
    if not _can_make_immutable(tmp_path):
        pytest.skip("chattr +i cannot make a folder unwritable here (no chattr, not root, or the file system lacks it)")
    from tests.test_worker import make_run

    run = make_run(str(tmp_path), "r")
    hook = tmp_path / "immutable_hook.py"
    hook.write_text(IMMUTABLE_HOOK)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "grpo_core.stages.worker", "train", "--until-step", "6", "--root", run],
            capture_output=True,
            text=True,
            env=dict(os.environ, GRPO_TEST_HOOK=f"{hook}:hook"),
            timeout=240,
        )
    finally:
        subprocess.run(["chattr", "-i", f"{run}/checkpoints"], capture_output=True, timeout=10)
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    errors = [e for e in events if e.get("event") == "error"]
    assert out.returncode == 11, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])  # ExitCode.STORAGE_LASTING
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [2]
    assert errors and errors[-1]["kind"] == "storage", errors
    msg = errors[-1]["message"]
    assert msg.startswith(f"cannot write checkpoint 4 at {run}/checkpoints/4: not permitted"), msg
    assert "Operation not permitted" in msg and "TimeoutError" not in out.stderr
