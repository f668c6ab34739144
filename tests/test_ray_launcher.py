"""The Ray launcher end to end (pipeline.launcher.kind: ray): a local Ray instance and two host
tasks run the training worker as a two-process JAX group, one process is SIGKILLed, and the
retry resumes to the same parameters as a run that was never killed.

A local Ray instance binds to every interface, so everything runs in a network namespace of the
test's own (`unshare -n`, loopback only: tests/ray_e2e.py). Every process started there carries a
marker in its environment; none may be left once the namespace's first process has exited.
"""

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

pytest.importorskip("ray")


def _can_unshare() -> bool:
    if not shutil.which("unshare"):
        return False
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _marked(mark: str) -> list[int]:
    """Processes whose environment holds `mark` (all descendants of the namespace's first one)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if mark.encode() in f.read():
                    with open(f"/proc/{name}/stat") as s:
                        if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                            pids.append(int(name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare(), reason="needs network namespaces (unshare -n)")
def test_ray_launcher_trains_is_killed_and_resumes_in_a_namespace(tmp_path):
    mark = f"GRPO_RAY_TEST_MARK={uuid.uuid4().hex}"
    key, value = mark.split("=")
    env = dict(
        os.environ,
        **{key: value},
        RAY_USAGE_STATS_ENABLED="0",
        RAY_OBJECT_STORE_MEMORY=str(200 * 2**20),
        PYTHONPATH=os.getcwd(),
    )
    script = 'ip link set lo up && exec "$0" "$@"'
    proc = subprocess.run(
        ["unshare", "-n", "sh", "-c", script, sys.executable, "-m", "tests.ray_e2e", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    left = _marked(mark)
    for pid in left:  # stop what outlived it, by pid, before failing on it
        os.kill(pid, 9)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not left, f"{len(left)} process(es) left running after the Ray runs"
    assert out["straight"] == ["start", "done"]
    assert out["fault_fired"] and "process 1 of 2" in out["kill"] and "signal 9" in out["kill"], out
    assert out["kill_retryable"] is True
    assert out["checkpoints_before_retry"] == [2]
    assert out["retry"] == [{"event": "resumed", "step": 2}, {"event": "done", "step": 6}]
    assert out["metric_steps"] == list(range(6))  # none lost, none twice
    assert out["max_param_diff"] < 1e-5
