"""The device half of the readiness stage, run in its own process:

    python -m grpo_core.readiness --request req.json     # prints one JSON report

Exit 0 ready, 4 a check failed, 2 the request is invalid. The request carries the model and
train configs, `max_prompt_tokens`, `require_tpu`, `rollout_engine` ("jax" | "sglang-jax"),
`config_hash`, and optionally `lockfile` and `memory_bytes` (device memory, overriding what
the backend reports). Each check reports ok, a detail and, when it fails, the fix to apply.
"""

from __future__ import annotations

import argparse
import enum
import fcntl
import json
import logging
import os
import re
import sys
import time
from typing import Any

from grpo_core.config import ConfigError, ModelConfig, TrainConfig

log = logging.getLogger(__name__)
EXIT_NOT_READY, EXIT_BAD_REQUEST = 4, 2
GiB = 1024**3
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


class RolloutEngine(enum.Enum):
    JAX = "jax"
    SGLANG_JAX = "sglang-jax"


def tpu_generation(device_kind: str) -> int | None:
    """'TPU v4' -> 4, 'TPU v5 lite'/'TPU v5e'/'TPU v5p' -> 5, 'TPU v6e' -> 6, 'TPU7x' -> 7."""
    m = re.match(r"\s*tpu\s*v?(\d+)", device_kind, re.IGNORECASE)
    return int(m.group(1)) if m else None


def check(name: str, ok: bool, detail: str, fix: str | None = None) -> dict[str, Any]:
    return {"name": name, "ok": bool(ok), "detail": detail, "fix": None if ok else fix}


def memory_budget(model: ModelConfig, train: TrainConfig, max_prompt_tokens: int, device_bytes: int | None,
                  device_count: int = 1) -> dict[str, Any]:
    """Bytes the run needs on its devices, by term, against what they have.

    params and gradients in param_dtype; AdamW's two moments in f32; a reference copy only with
    beta > 0; the rollout batch's KV cache; and the largest activation, the logits of one
    update micro-batch in f32 (prompt + completion tokens x vocabulary)."""
    n = model.num_params()
    pbytes, cbytes = _DTYPE_BYTES[model.param_dtype.value], _DTYPE_BYTES[model.dtype.value]
    g, s = train.grpo, train.sampling
    rows = g.batch_size
    seq = max_prompt_tokens + s.max_new_tokens
    micro_rows = rows // (g.minibatches_per_rollout * g.grad_accum_steps)
    terms = {
        "params": n * pbytes,
        "gradients": n * pbytes,
        "optimizer": 2 * n * 4,
        "reference": n * pbytes if g.beta > 0 else 0,
        "kv_cache": 2 * model.num_hidden_layers * rows * seq * model.num_key_value_heads * model.head_dim * cbytes,
        "logits": micro_rows * seq * model.vocab_size * 4,
    }
    total = sum(terms.values())
    out: dict[str, Any] = {"terms_bytes": terms, "total_bytes": total, "total_gib": round(total / GiB, 3),
                           "available_bytes": device_bytes, "fits": None, "largest": max(terms, key=terms.get)}
    if device_bytes is not None:
        out["fits"] = total <= device_bytes
    return out


def _lever(budget: dict[str, Any], train: TrainConfig) -> str:
    g, s = train.grpo, train.sampling
    need, have = budget["total_bytes"] / GiB, (budget["available_bytes"] or 0) / GiB
    head = f"needs {need:.2f} GiB, devices have {have:.2f} GiB; largest term {budget['largest']}: "
    return head + {
        "kv_cache": f"lower train.grpo.prompts_per_step (now {g.prompts_per_step}) or train.sampling.max_new_tokens "
                    f"(now {s.max_new_tokens}) or data.max_prompt_tokens",
        "logits": f"raise train.grpo.grad_accum_steps (now {g.grad_accum_steps}) to split each update",
        "reference": "set train.grpo.beta=0 (no reference copy), or use a smaller model",
    }.get(budget["largest"], "use a smaller model preset, bfloat16 parameters (model.param_dtype=bfloat16), "
                             "or shard over more devices")


def lock_holders(path: str) -> list[int]:
    """Pids holding a POSIX (lockf/fcntl) lock on `path`, from /proc/locks, which lists every
    user's locks (unlike /proc/*/fd, which hides other users' processes)."""
    try:
        ino = os.stat(path).st_ino
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    pids = set()
    for line in lines:  # "1: POSIX  ADVISORY  WRITE 27441 fe:00:2196545 0 EOF"; "1: -> ..." are waiters
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "POSIX" and parts[5].rsplit(":", 1)[-1] == str(ino):
            pids.add(int(parts[4]))
    return sorted(pids - {os.getpid()})


def lockfile_state(path: str) -> str:
    """'absent', 'free', 'held' or 'foreign' (we may not open it).

    libtpu opens the file O_CREAT|O_RDWR 0600 and takes `lockf(fd, F_TLOCK, 0)` (a POSIX record
    lock, not flock) for its whole life, unlinking the file at a clean exit. So the same
    non-blocking lockf is the ground truth for "in use"; a file that merely exists or is open
    means nothing. Our probe lock is released when we close the fd, before JAX starts."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return "absent"
    except PermissionError:  # another user's 0600 file: libtpu's own open fails the same way
        return "foreign"
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "free"
    except OSError:
        return "held"
    finally:
        os.close(fd)


def _lockfile_check(path: str) -> dict[str, Any]:
    state = lockfile_state(path)
    if state == "absent":
        return check("tpu_lockfile", True, f"{path} absent")
    holders = lock_holders(path)
    if holders or state == "held":
        who = f"process(es) {holders}" if holders else "a process we cannot see"
        return check("tpu_lockfile", False, f"the TPU is in use: {path} is held by {who}",
                     f"stop process {holders[0]} (or wait for it to finish)" if holders
                     else f"find it with: sudo lsof -w {path} /dev/accel0")
    sudo = "sudo " if state == "foreign" else ""
    return check("tpu_lockfile", False, f"stale {path}: no process holds it, but libtpu will report the TPU "
                                        "as already in use", f"remove it: {sudo}rm {path}")


def _device_checks(req: dict[str, Any], report: dict[str, Any]) -> list[dict[str, Any]]:
    import jax

    try:
        devices = jax.devices()
    except RuntimeError as exc:
        busy = "in use" in str(exc).lower()
        return [check("backend", False, f"no accelerator backend: {exc}",
                      "stop the other process using the TPU or remove a stale /tmp/libtpu_lockfile" if busy
                      else "check the JAX installation (jax[tpu] on TPU VMs)")]
    d0 = devices[0]
    report.update(backend=d0.platform, device_kind=d0.device_kind, device_count=len(devices),
                  local_device_count=jax.local_device_count(), process_count=jax.process_count(),
                  process_index=jax.process_index(), tpu_generation=tpu_generation(d0.device_kind))
    out = [check("backend", True, f"{d0.platform}: {len(devices)} x {d0.device_kind}")]
    out.append(check("tpu_required", d0.platform == "tpu" or not req.get("require_tpu"),
                     f"backend is {d0.platform}" + (", a TPU is required" if req.get("require_tpu") else ""),
                     f"run on a TPU VM, or set pipeline.require_tpu=false to run on {d0.platform}"))
    out.append(_engine_check(req["rollout_engine"], report))
    out.append(_agreement_check(req.get("config_hash", ""), report["process_count"]))
    return out


def _engine_check(engine: RolloutEngine, report: dict[str, Any]) -> dict[str, Any]:
    if engine is RolloutEngine.JAX:
        return check("rollout_engine", True, "built-in JAX sampler (any backend, multi-host)")
    gen = report.get("tpu_generation")
    if gen is None or gen < 4:
        found = f"TPU v{gen}" if gen else report.get("backend")
        return check("rollout_engine", False, f"sglang-jax's paged attention needs TPU v4 or newer, found {found}",
                     "use the built-in rollout engine 'jax'")
    if report["process_count"] > 1:
        return check("rollout_engine", False, "in-process sglang-jax fails on multi-host slices "
                     "(FAILED_PRECONDITION: the program continuator has halted)", "use the rollout engine 'jax'")
    return check("rollout_engine", True, f"sglang-jax on TPU v{gen}, single host")


def _agreement_check(config_hash: str, process_count: int) -> dict[str, Any]:
    if process_count == 1:
        return check("config_agreement", True, "1 process")
    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.frombuffer(config_hash.encode().ljust(64, b"\0")[:64], np.uint8)
    try:
        multihost_utils.assert_equal(mine, "config hashes differ across processes")
    except AssertionError as exc:
        return check("config_agreement", False, str(exc), "start every process with the same config.json")
    return check("config_agreement", True, f"{process_count} processes agree on config {config_hash}")


def _device_memory(report: dict[str, Any], override: int | None) -> int | None:
    if override is not None:
        return int(override)
    if report.get("backend") == "cpu":  # host RAM, shared by every CPU device
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import jax

    # One device's limit, not the sum: the trainer has no mesh yet, it puts params, optimizer
    # state, the KV cache and the batch on the default device.
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return None if limit is None else int(limit)


def parse_request(req: Any) -> dict[str, Any]:
    """The request with its configs built and its scalars checked; ConfigError names the field."""
    if not isinstance(req, dict):
        raise ConfigError(f"the readiness request must be a JSON object, got {type(req).__name__}")
    for key in ("model", "train", "max_prompt_tokens"):
        if key not in req:
            raise ConfigError(f"readiness request lacks {key!r}")
    for key in ("model", "train"):
        if not isinstance(req[key], dict):
            raise ConfigError(f"request.{key} must be a mapping, got {req[key]!r}")
    for key, none_ok in (("max_prompt_tokens", False), ("memory_bytes", True)):
        v = req.get(key)
        if not (isinstance(v, int) and not isinstance(v, bool) and v > 0) and not (none_ok and v is None):
            raise ConfigError(f"request.{key} must be a positive integer{' or null' if none_ok else ''}, got {v!r}")
    try:
        engine = RolloutEngine(req.get("rollout_engine", "jax"))
    except ValueError:
        raise ConfigError(f"request.rollout_engine must be one of {[e.value for e in RolloutEngine]}, "
                          f"got {req.get('rollout_engine')!r}") from None
    return dict(req, model=ModelConfig.from_dict(req["model"]), train=TrainConfig.from_dict(req["train"]),
                rollout_engine=engine)


def run_checks(req: dict[str, Any]) -> dict[str, Any]:
    t = time.perf_counter()
    req = parse_request(req)
    model, train = req["model"], req["train"]
    report: dict[str, Any] = {"ready": False, "backend": None, "device_kind": None, "device_count": 0,
                              "local_device_count": 0, "process_count": 1, "process_index": 0,
                              "tpu_generation": None, "config_hash": req.get("config_hash", "")}
    checks = [_lockfile_check(req.get("lockfile") or "/tmp/libtpu_lockfile")]  # before JAX opens a TPU
    checks += _device_checks(req, report)
    if report["backend"] is not None:
        budget = memory_budget(model, train, req["max_prompt_tokens"],
                               _device_memory(report, req.get("memory_bytes")), report["device_count"])
        report["memory"] = budget
        have = "unknown" if budget["available_bytes"] is None else f"{budget['available_bytes'] / GiB:.2f} GiB"
        checks.append(check("memory", budget["fits"] is not False,
                            f"needs ~{budget['total_gib']:.2f} GiB of {have}", _lever(budget, train)))
    report["checks"] = checks
    report["ready"] = all(c["ok"] for c in checks)
    report["seconds"] = round(time.perf_counter() - t, 3)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grpo_core.readiness", description=__doc__.split("\n")[0])
    ap.add_argument("--request", required=True, help="JSON request file")
    args = ap.parse_args(argv)
    try:
        with open(args.request) as f:
            req = json.load(f)
        report = run_checks(req)
    except (OSError, json.JSONDecodeError, ConfigError, TypeError) as exc:
        print(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}", "checks": []}))
        return EXIT_BAD_REQUEST
    print(json.dumps(report))
    return 0 if report["ready"] else EXIT_NOT_READY


if __name__ == "__main__":
    sys.exit(main())
