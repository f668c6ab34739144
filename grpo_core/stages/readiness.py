"""The device half of the readiness stage, run in its own process:

    python -m grpo_core.stages.readiness --request req.json     # prints one JSON report

Exit 0 ready, 4 a check failed, 2 the request is invalid. The request carries the model and
train configs, `max_prompt_tokens`, `require_tpu`, `rollout_engine` ("jax" | "sglang" | "http"),
`config_hash`, and optionally `lockfile`, `memory_bytes` (device memory, overriding what
the backend reports), `lora` (the model.lora section) and `run_root` (with several processes,
each checks it reads the same config and first batch from there as the others). Each check reports ok, a detail and,
when it fails, the fix to apply.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import logging
import os
import re
import sys
import time
from importlib.metadata import version
from typing import Any

from grpo_core import tpu_chips_here
from grpo_core.config.memory import RewardModelShape
from grpo_core.config.model import LoraConfig, ModelConfig
from grpo_core.config.train import RolloutEngineKind, TrainConfig
from grpo_core.errors import ConfigError, ExitCode

# What only some checks or the run itself need (JAX, numpy, storage, the memory plan, subprocess)
# is imported in the function that needs it, marked `# worker start`: `--help` and a bad request
# answer at once.

log = logging.getLogger(__name__)


RolloutEngine = RolloutEngineKind  # "sglang-jax" is accepted for "sglang"


def tpu_generation(device_kind: str) -> int | None:
    """'TPU v4' -> 4, 'TPU v5 lite'/'TPU v5e'/'TPU v5p' -> 5, 'TPU v6e' -> 6, 'TPU7x' -> 7."""
    m = re.match(r"\s*tpu\s*v?(\d+)", device_kind, re.IGNORECASE)
    return int(m.group(1)) if m else None


def check(name: str, ok: bool, detail: str, fix: str | None = None) -> dict[str, Any]:
    return {"name": name, "ok": bool(ok), "detail": detail, "fix": None if ok else fix}


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
        return check(
            "tpu_lockfile",
            False,
            f"the TPU is in use: {path} is held by {who}",
            f"stop process {holders[0]} (or wait for it to finish)"
            if holders
            else f"find it with: sudo lsof -w {path} /dev/accel0",
        )
    sudo = "sudo " if state == "foreign" else ""
    return check(
        "tpu_lockfile",
        False,
        f"stale {path}: no process holds it, but libtpu will report the TPU as already in use",
        f"remove it: {sudo}rm {path}",
    )


def _tpu_lockfile_check(path: str | None) -> dict[str, Any]:
    """The lockfile check where it means something: a host with TPU chips (or a lockfile the
    request names). On a host without TPU chips, libtpu's lockfile says nothing about this run:
    a TPU process elsewhere on the machine, or an AOT check loading libtpu's compiler, may hold
    it while a CPU or GPU run goes on beside it."""
    if path is None and not tpu_chips_here():
        return check("tpu_lockfile", True, "no TPU chips on this host: libtpu's lockfile is not this run's concern")
    return _lockfile_check(path or "/tmp/libtpu_lockfile")


def _device_checks(req: dict[str, Any], report: dict[str, Any]) -> list[dict[str, Any]]:
    import jax  # worker start: JAX

    try:
        devices = jax.devices()
    except RuntimeError as exc:
        busy = "in use" in str(exc).lower()
        return [
            check(
                "backend",
                False,
                f"no accelerator backend: {exc}",
                "stop the other process using the TPU or remove a stale /tmp/libtpu_lockfile"
                if busy
                else "check the JAX installation (jax[tpu] on TPU VMs)",
            )
        ]
    d0 = devices[0]
    report.update(
        backend=d0.platform,
        device_kind=d0.device_kind,
        device_count=len(devices),
        local_device_count=jax.local_device_count(),
        process_count=jax.process_count(),
        process_index=jax.process_index(),
        tpu_generation=tpu_generation(d0.device_kind),
    )
    out = [check("backend", True, f"{d0.platform}: {len(devices)} x {d0.device_kind}")]
    out.append(
        check(
            "tpu_required",
            d0.platform == "tpu" or not req.get("require_tpu"),
            f"backend is {d0.platform}" + (", a TPU is required" if req.get("require_tpu") else ""),
            f"run on a TPU VM, or set pipeline.require_tpu=false to run on {d0.platform}",
        )
    )
    out.append(_engine_check(req["rollout_engine"], report, req["model"], req["train"].rollout))
    out.append(_mesh_check(req["train"], len(devices)))
    out.append(_agreement_check(req, report["process_count"]))
    return out


def _engine_check(
    engine: RolloutEngineKind, report: dict[str, Any], model: ModelConfig | None = None, rollout=None
) -> dict[str, Any]:
    """Can this slice run the chosen rollout engine? In-process sglang-jax: one host, TPU v4 or
    newer (its paged attention kernels), or CPU for tests; and an interpreter that has it."""
    if engine is RolloutEngineKind.JAX:
        return check("rollout_engine", True, "built-in JAX sampler (any backend, multi-host)")
    if engine is RolloutEngineKind.HTTP:
        return _server_check(rollout)
    instead = "use train.rollout.engine=jax (the built-in sampler), or http with a server on other hosts"
    if report["process_count"] > 1:
        return check(
            "rollout_engine",
            False,
            f"in-process sglang-jax fails on multi-host slices ({report['process_count']} "
            "processes: FAILED_PRECONDITION, the program continuator has halted)",
            instead,
        )
    gen, backend = report.get("tpu_generation"), report.get("backend")
    head_dim = model.head_dim if model is not None else None
    if backend == "cpu" and head_dim is not None and head_dim % 128 == 0:
        where = "CPU (tests and development: slow)"
    elif backend == "tpu" and gen is not None and gen >= 4:
        where = f"TPU v{gen}, single host"
    else:
        found = (
            f"TPU v{gen}" if gen else f"{backend}" + (f" with model.head_dim {head_dim}" if backend == "cpu" else "")
        )
        return check(
            "rollout_engine",
            False,
            "sglang-jax's paged attention needs TPU v4 or newer (or, for tests, CPU "
            f"with model.head_dim a multiple of 128); found {found}",
            instead,
        )
    if importlib.util.find_spec("sgl_jax") is None:
        return check(
            "rollout_engine",
            False,
            f"sglang-jax is not installed for {sys.executable}",
            "build the sglang-jax environment (make sglang-env) and start workers with it "
            "(GRPO_SGLANG_PYTHON or pipeline.worker_python; the pipeline picks .venv-sglang itself)",
        )
    return check("rollout_engine", True, f"sglang-jax {version('sglang-jax')} in process on {where}")


def _server_check(rollout) -> dict[str, Any]:
    """http: a server at train.rollout.url must answer now; one started per run needs its interpreter."""
    if rollout is None:
        return check("rollout_engine", True, "OpenAI-compatible rollout server (not probed)")
    if rollout.url:
        import urllib.error  # worker start: with urllib.request

        from grpo_core.addresses import open_url, redirect_of  # worker start: urllib.request, ssl

        url = rollout.url.rstrip("/") + "/v1/models"
        try:
            with open_url(url, timeout=10) as resp:  # no redirect followed: only the allowed address is asked
                return check(
                    "rollout_engine",
                    resp.status == 200,
                    f"rollout server {url}: HTTP {resp.status}",
                    "check the server at train.rollout.url",
                )
        except urllib.error.HTTPError as exc:
            where = redirect_of(exc)
            return check(
                "rollout_engine",
                False,
                f"rollout server {url}: HTTP {exc.code}" + (f", a redirect to {where} (not followed)" if where else ""),
                "set train.rollout.url to the server's own address"
                if where
                else "check the server at train.rollout.url",
            )
        except (urllib.error.URLError, OSError) as exc:
            return check(
                "rollout_engine",
                False,
                f"rollout server {url} did not answer within 10 s: {getattr(exc, 'reason', exc)}",
                "start the server or fix train.rollout.url",
            )
    if rollout.server == "sglang-jax":
        from grpo_core.launch.processes import sglang_python  # worker start: subprocess

        py = sglang_python()
        return check(
            "rollout_engine",
            py is not None,
            f"sglang-jax servers started with {py}"
            if py
            else "train.rollout.server=sglang-jax needs the sglang-jax environment, which is not built",
            "make sglang-env, or set GRPO_SGLANG_PYTHON to its python",
        )
    return check("rollout_engine", True, f"rollout servers started with: {' '.join(rollout.server_command)}")


def _mesh_check(train: TrainConfig, device_count: int) -> dict[str, Any]:
    """train.mesh (and its rollout / reference layouts) must divide the devices of the run."""
    m, shown = train.mesh, []
    try:
        for field, shape in (
            ("train.mesh", m),
            ("train.mesh.rollout", m.rollout),
            ("train.mesh.reference", m.reference),
        ):
            if shape is not None:
                sizes = shape.sizes(device_count, field)
                shown.append(
                    f"{field.rsplit('.', 1)[-1] if shape is not m else 'train'} "
                    + " x ".join(f"{a}={n}" for a, n in zip(("data", "fsdp", "tensor"), sizes))
                )
    except ConfigError as exc:
        return check("mesh", False, str(exc), f"make the axes multiply to {device_count}, or set one of them to -1")
    return check("mesh", True, f"{'; '.join(shown)} over {device_count} devices")


def _agreement_check(req: dict[str, Any], process_count: int) -> dict[str, Any]:
    """Every process of a multi-host run must see the same config and draw the same first batch:
    each computes both from what it reads itself (the run root's config.json and prepared data,
    when the request names `run_root`) and one collective compares them (distributed.disagreements)."""
    if process_count == 1:
        return check("config_agreement", True, "1 process")
    from grpo_core.launch import cluster as distributed  # worker start: numpy

    values, unread = {"config hash": req.get("config_hash", ""), "first batch": ""}, None
    if req.get("run_root"):
        try:
            values["config hash"], values["first batch"] = _run_digests(req["run_root"])
        except Exception as exc:  # noqa: BLE001 - still take part in the collective: with a value that differs
            unread = f"{type(exc).__name__}: {exc}"  # from any process that could read it
            values["first batch"] = f"unreadable: {unread}"
    differ = distributed.disagreements(values)
    if differ:
        detail = "; ".join(
            f"the {name} of process(es) {procs} differs from process 0's" for name, procs in differ.items()
        )
        return check(
            "config_agreement",
            False,
            detail,
            "start every process on the same run root and code (one config.json, one prepared data set)",
        )
    batch = (
        " and the first batch"
        if req.get("run_root") and unread is None
        else f" (the first batch not compared: {unread or 'no run_root in the request'})"
    )
    return check("config_agreement", True, f"{process_count} processes agree on config {values['config hash']}{batch}")


def _run_digests(run_url: str) -> tuple[str, str]:
    """(training hash, first batch digest) as this process reads them from the run root."""
    from grpo_core.config.run import RunConfig  # worker start: config
    from grpo_core.data.prepare import DatasetPrompts, load_prepared  # worker start: fsspec
    from grpo_core.launch import cluster as distributed  # worker start: numpy
    from grpo_core.store.root import RunRoot  # worker start: fsspec

    root = RunRoot(run_url)
    cfg = RunConfig.from_dict(root.read_json("config.json"))
    rows, _ = load_prepared(root, cfg.data_hash)
    prompts = DatasetPrompts(rows, seed=cfg.data.seed)
    return cfg.train_hash, distributed.first_batch_digest(prompts, 0, cfg.train.grpo.prompts_per_step)


def _device_memory(report: dict[str, Any], override: int | None) -> int | None:
    """One device's memory (the plan counts per device, as train.mesh splits the run); on CPU the
    host's, shared by every CPU device."""
    if override is not None:
        return int(override)
    from grpo_core.config import memory  # worker start: config

    return memory.device_facts()["available"]


def _runtime_bytes() -> int:
    """On CPU the training worker's own size counts against the host's memory: this process after
    importing what the worker imports (JAX, Flax, Optax, Orbax, the data and reward stack) is the
    same program before its first array."""
    import grpo_core.rl.checkpoint  # noqa: F401 - imported to be measured, as the worker imports it
    import grpo_core.rl.trainer  # noqa: F401 - as above
    import grpo_core.stages.parts  # noqa: F401 - as above
    from grpo_core.config import memory  # worker start: config

    return memory.rss_bytes()


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
        section = req["train"].get("rollout")
        engine = RolloutEngine(
            req.get("rollout_engine", section.get("engine", "jax") if isinstance(section, dict) else "jax")
        )
    except ValueError:
        raise ConfigError(
            f"request.rollout_engine must be one of {[e.value for e in RolloutEngine]}, "
            f"got {req.get('rollout_engine')!r}"
        ) from None
    lora = None
    if req.get("lora"):
        lora = LoraConfig.from_value(req["lora"])
    rms = req.get("reward_models") or []
    if not isinstance(rms, list):
        raise ConfigError(f"request.reward_models must be a list, got {rms!r}")
    return dict(
        req,
        model=ModelConfig.from_dict(req["model"]),
        train=TrainConfig.from_dict(req["train"]),
        rollout_engine=engine,
        lora=lora,
        reward_models=tuple(RewardModelShape.from_dict(r) for r in rms),
    )


def run_checks(req: dict[str, Any]) -> dict[str, Any]:
    from grpo_core.config import memory  # worker start: config

    t = time.perf_counter()
    req = parse_request(req)
    model, train = req["model"], req["train"]
    report: dict[str, Any] = {
        "ready": False,
        "backend": None,
        "device_kind": None,
        "device_count": 0,
        "local_device_count": 0,
        "process_count": 1,
        "process_index": 0,
        "tpu_generation": None,
        "config_hash": req.get("config_hash", ""),
    }
    checks = [_tpu_lockfile_check(req.get("lockfile"))]  # before JAX opens a TPU
    checks += _device_checks(req, report)
    if report["backend"] is not None:
        cpu = report["backend"] == "cpu"
        facts = {
            "backend": report["backend"],
            "devices": report["device_count"],
            "available": _device_memory(report, req.get("memory_bytes")),
            "runtime": _runtime_bytes() if cpu else 0,
        }
        plan = memory.plan_on(
            model,
            train,
            req["max_prompt_tokens"],
            facts,
            req["lora"],
            bool(req.get("separate_reference")),
            reward_models=req["reward_models"],
        )
        report["memory"] = plan.report()
        checks.append(check("memory", plan.fits is not False, plan.describe(), plan.lever(train)))
    report["checks"] = checks
    report["ready"] = all(c["ok"] for c in checks)
    report["seconds"] = round(time.perf_counter() - t, 3)
    return report


def answer(req: Any) -> tuple[dict[str, Any], int]:
    """The report for `req` and the exit code that says it (a request that cannot be checked:
    {"ready": false, "error": ...}). Also what a worker started ahead runs before its stage
    (grpo_core.stages.ahead), so that the pipeline's first stage trains in this process."""
    from grpo_core.launch import cluster as distributed  # worker start: numpy

    try:
        report = run_checks(req)
    except (OSError, ConfigError, TypeError, distributed.DistributedError) as exc:
        return _refused(exc), ExitCode.CONFIG
    return report, ExitCode.OK if report["ready"] else ExitCode.NOT_READY


def _refused(exc: BaseException) -> dict[str, Any]:
    return {"ready": False, "error": f"{type(exc).__name__}: {exc}", "checks": []}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grpo_core.stages.readiness", description=__doc__.split("\n")[0])
    ap.add_argument("--request", help="JSON request file")
    ap.add_argument("--request-json", help="the request itself (a launcher passes it to other hosts this way)")
    ap.add_argument(
        "--events",
        action="store_true",
        help='print the report as {"event": "report", "report": ...} and exit 0 (for tasks.process)',
    )
    args = ap.parse_args(argv)
    from grpo_core.launch import cluster as distributed  # worker start: numpy

    primary = True
    try:
        if not (args.request or args.request_json):
            raise ConfigError("give --request FILE or --request-json JSON")
        if args.request_json:
            req = json.loads(args.request_json)
        else:
            with open(args.request) as f:
                req = json.load(f)
        cluster = distributed.from_env()  # started by a multi-host launcher: join the others first
        distributed.initialize(cluster)
        primary = cluster is None or distributed.is_primary()
    except (OSError, json.JSONDecodeError, ConfigError, TypeError, distributed.DistributedError) as exc:
        report, code = _refused(exc), ExitCode.CONFIG
    else:
        report, code = answer(req)
    if primary:  # one report per run, not one per host
        print(json.dumps({"event": "report", "report": report} if args.events else report), flush=True)
    return 0 if args.events else code


if __name__ == "__main__":
    sys.exit(main())
