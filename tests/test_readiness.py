"""Readiness: TPU generations, the memory budget with pinned numbers, and the checks as a real
process on this machine's CPU (TPU required, a stale or held lockfile, too little memory)."""

import json
import subprocess
import sys

import pytest

from grpo_core.config.presets import get_preset
from grpo_core.config.train import TrainConfig
from grpo_core.stages.readiness import tpu_generation


@pytest.mark.parametrize(
    "kind, gen",
    [
        ("TPU v3", 3),
        ("TPU v4", 4),
        ("TPU v5 lite", 5),
        ("TPU v5e", 5),
        ("TPU v5p", 5),
        ("TPU v6 lite", 6),
        ("TPU v6e", 6),
        ("TPU7x", 7),
        ("cpu", None),
        ("NVIDIA H100 80GB HBM3", None),
    ],
)
def test_tpu_generation(kind, gen):
    assert tpu_generation(kind) == gen


def test_memory_plan_pinned():
    from grpo_core.config import memory

    m = get_preset("tiny", vocab_size=50)
    n = m.num_params()
    train = TrainConfig.from_dict(
        {"grpo": {"num_generations": 4, "prompts_per_step": 2}, "sampling": {"max_new_tokens": 6}}
    )
    p = memory.plan(m, train, 10, 10**9, runtime_bytes=7)
    t = p.estimate.terms
    assert t["params"] == t["gradients"] == 4 * n and t["optimizer"] == 8 * n and t["reference"] == 0
    assert (
        t["kv_cache"] == 2 * 2 * 8 * 18 * 2 * 32 * 4
    )  # k,v x layers x rows x (12-token bucket + 6) x kv heads x head_dim x f32
    assert t["runtime"] == 7 and t["programs"] == memory.CPU_PROGRAMS_BYTES
    assert p.estimate.total == p.estimate.resident + max(p.estimate.phases.values()) and p.fits is True
    assert (p.estimate.remat.value, p.estimate.grad_accum_steps) == ("dots", 1)  # plenty of room: CPU's fastest
    with_ref = memory.plan(m, train.replace(grpo=train.grpo.replace(beta=0.04)), 10, None)
    assert with_ref.estimate.terms["reference"] == 4 * n and with_ref.fits is None


def run_readiness(tmp_path, **overrides):
    m = get_preset("tiny", vocab_size=50)
    req = {
        "model": m.to_dict(),
        "train": TrainConfig().to_dict(),
        "max_prompt_tokens": 16,
        "require_tpu": False,
        "rollout_engine": "jax",
        "config_hash": "abc",
        "lockfile": str(tmp_path / "libtpu_lockfile"),
        **overrides,
    }
    path = tmp_path / "req.json"
    path.write_text(json.dumps(req))
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_core.stages.readiness", "--request", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return proc.returncode, report, {c["name"]: c for c in report["checks"]}


def test_ready_on_cpu_and_tpu_required(tmp_path):
    rc, report, checks = run_readiness(tmp_path)
    assert rc == 0 and report["ready"] and report["backend"] == "cpu" and report["device_count"] >= 1
    assert report["memory"]["fits"] is True and checks["tpu_lockfile"]["ok"]
    rc, report, checks = run_readiness(tmp_path, require_tpu=True, rollout_engine="sglang-jax")
    assert rc == 4 and not report["ready"]
    assert "pipeline.require_tpu=false" in checks["tpu_required"]["fix"]
    assert "needs TPU v4 or newer" in checks["rollout_engine"]["detail"]


def test_stale_and_held_lockfiles(tmp_path):
    lock = tmp_path / "libtpu_lockfile"
    lock.write_text("")
    rc, _, checks = run_readiness(tmp_path)
    assert rc == 4 and checks["tpu_lockfile"]["fix"] == f"remove it: rm {lock}"
    # The holder locks the file as libtpu does: open O_CREAT|O_RDWR, lockf(F_TLOCK), keep the fd.
    take_lock = (
        f"import fcntl, os, sys, time; fd = os.open({str(lock)!r}, os.O_CREAT | os.O_RDWR, 0o600); "
        "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('locked', flush=True); time.sleep(120)"
    )
    holder = subprocess.Popen([sys.executable, "-c", take_lock], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        rc, _, checks = run_readiness(tmp_path)
        assert rc == 4 and f"held by process(es) [{holder.pid}]" in checks["tpu_lockfile"]["detail"]
        assert checks["tpu_lockfile"]["fix"].startswith(f"stop process {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    # Open but not locked (a shell, an editor): libtpu would get the lock, so this is only stale.
    opener = subprocess.Popen(
        [sys.executable, "-c", f"f = open({str(lock)!r}); print('open', flush=True); import time; time.sleep(120)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert opener.stdout.readline().strip() == "open"
        rc, _, checks = run_readiness(tmp_path)
        assert rc == 4 and checks["tpu_lockfile"]["detail"].startswith("stale")
    finally:
        opener.kill()
        opener.wait()
        opener.stdout.close()


def test_memory_that_does_not_fit_names_a_lever(tmp_path):
    rc, report, checks = run_readiness(tmp_path, memory_bytes=1000)
    assert rc == 4 and report["memory"]["fits"] is False
    assert "largest term" in checks["memory"]["fix"] and "GiB" in checks["memory"]["fix"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"train": {"grpo": {"num_generations": 1}}}, "num_generations must be >= 2, got 1"),
        ({"max_prompt_tokens": "16"}, "request.max_prompt_tokens must be a positive integer, got '16'"),
        ({"memory_bytes": "lots"}, "request.memory_bytes must be a positive integer or null, got 'lots'"),
        ({"rollout_engine": "vllm"}, "request.rollout_engine must be one of ['jax', 'sglang', 'http'], got 'vllm'"),
        ({"model": [1, 2]}, "request.model must be a mapping, got [1, 2]"),
    ],
)
def test_bad_request(tmp_path, overrides, message):
    rc, report, _ = run_readiness(tmp_path, **overrides)
    assert rc == 2 and message in report["error"]


def test_a_host_without_tpu_chips_ignores_libtpus_lockfile():
    """On a host with no TPU chips the lockfile is not looked at, whoever holds it (a TPU process
    of another user, an AOT check loading libtpu's compiler): a CPU or GPU run goes on."""
    from grpo_core import tpu_chips_here
    from grpo_core.stages.readiness import _tpu_lockfile_check

    if tpu_chips_here():
        pytest.skip("this host has TPU chips")
    result = _tpu_lockfile_check(None)
    assert result["ok"] and "no TPU chips on this host" in result["detail"]
