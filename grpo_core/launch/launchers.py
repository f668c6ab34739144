"""Launchers: how a stage's worker process starts, on this machine or on every host of a slice.

    pipeline:
      launcher: {kind: local}                                     # one process here (default)
      launcher: {kind: multiprocess, num_processes: 2}            # N processes on 127.0.0.1, CPU devices
      launcher: {kind: ray, address: auto, num_processes: 4,      # one Ray task per host of a cluster
                 resources_per_host: {TPU: 4}}
      launcher: {kind: tpu-vm, tpu_name: my-v4-16, zone: us-central2-b, project: my-proj}

Every launcher runs the same `python -m <module> <args>` in every process and tells each one who
it is (grpo_core.launch.cluster reads it): `multiprocess` and `ray` through GRPO_COORDINATOR /
GRPO_NUM_PROCESSES / GRPO_PROCESS_ID; `tpu-vm` through GRPO_DISTRIBUTED=auto, since JAX reads
the coordinator (worker 0) from the TPU VM's metadata. Process 0 prints the events.

`start` returns local `subprocess.Popen`s that the caller watches (tasks.process): for
`multiprocess`, the N workers themselves; for `ray`, a driver (`python -m grpo_core.launch.launchers ray
...`) that submits one task per host, relays process 0's output and exits with the first
failure; for `tpu-vm`, `gcloud compute tpus tpu-vm ssh --worker=all`, whose remote processes
`Launched.stop` ends by the pid files they wrote. Stopping the local processes stops the set:
a Ray job's tasks die with their driver (and each task's worker dies with its task).

This module runs in the Prefect process: it never imports JAX, and Ray only in the driver.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import ctypes
import dataclasses
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import uuid
from typing import Any, Sequence

from grpo_core.config.fields import field
from grpo_core.config.launch import LauncherConfig, LauncherKind  # the pipeline.launcher section; re-exported
from grpo_core.errors import ConfigError
from grpo_core.launch.cluster import (
    ENV_COORDINATOR,
    ENV_DISTRIBUTED,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_INIT_TIMEOUT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from grpo_core.launch.processes import ENV_WATCH_PARENT, free_port, signal_group, stop_process_groups


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """One local process to start: its command line and the variables added to its environment."""

    name: str = field()
    argv: list[str] = field()
    env: dict[str, str] = field()


@dataclasses.dataclass
class Launched:
    """A started stage. procs[0] prints the events; stop() ends every process of the set."""

    cfg: LauncherConfig = field()
    specs: list[ProcessSpec] = field()
    procs: list[subprocess.Popen] = field()
    stop_argv: list[str] | None = field(None, doc="tpu-vm: the remote kill")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every local process group, then SIGKILL what is left; remote processes by
        their pid files (tpu-vm)."""
        if self.stop_argv:
            try:
                subprocess.run(self.stop_argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop_process_groups(self.procs, grace_s)


def _timeouts(cfg: LauncherConfig) -> dict[str, str]:
    return {ENV_INIT_TIMEOUT: str(cfg.init_timeout_s), ENV_HEARTBEAT_TIMEOUT: str(cfg.heartbeat_timeout_s)}


def _xla_flags(existing: str, devices: int) -> str:
    flags = [f for f in existing.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])


def plan(
    cfg: LauncherConfig,
    module_args: Sequence[str],
    env: dict[str, str] | None = None,
    python: str | None = None,
    token: str | None = None,
) -> tuple[list[ProcessSpec], list[str] | None]:
    """The local processes `start` would start for `python -m <module_args>`, and the remote
    stop command (tpu-vm). Pure: the unit tests check it. `env`: extra variables for the worker."""
    env, python = dict(env or {}), python or sys.executable
    module_args = list(module_args)
    if cfg.kind in (LauncherKind.LOCAL, LauncherKind.MULTIPROCESS):
        env[ENV_WATCH_PARENT] = "1"  # local workers stop when the process that started them is gone
    if cfg.kind is LauncherKind.LOCAL:
        return [ProcessSpec("worker", [python, "-m", *module_args], env)], None
    if cfg.kind is LauncherKind.MULTIPROCESS:
        port = cfg.coordinator_port or free_port()
        base = dict(
            env,
            JAX_PLATFORMS="cpu",
            **_timeouts(cfg),
            XLA_FLAGS=_xla_flags(env.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")), cfg.devices_per_process),
        )
        n = cfg.num_processes
        return [
            ProcessSpec(
                f"process {i}",
                [python, "-m", *module_args],
                dict(base, **{ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(n), ENV_PROCESS_ID: str(i)}),
            )
            for i in range(n)
        ], None
    if cfg.kind is LauncherKind.RAY:
        argv = [
            python,
            "-m",
            "grpo_core.launch.launchers",
            "ray",
            "--address",
            cfg.address,
            "--hosts",
            str(cfg.num_processes),
            "--port",
            str(cfg.coordinator_port or 8476),
            "--strategy",
            cfg.placement_strategy,
            "--resources",
            json.dumps(cfg.resources_per_host or {"CPU": 1}, sort_keys=True),
            "--env",
            json.dumps(dict(env, **_timeouts(cfg)), sort_keys=True),
            "--",
            *module_args,
        ]
        return [ProcessSpec("ray driver", argv, {})], None
    token = token or uuid.uuid4().hex[:12]
    pidfile = f"/tmp/grpo-worker-{token}.pid"
    remote_env = dict(env, **{ENV_DISTRIBUTED: "auto"}, **_timeouts(cfg))
    assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(remote_env.items()))
    remote = (
        f"cd {cfg.workdir} && echo $$ > {pidfile} && exec env {assigns} "
        f"{cfg.python} -m {' '.join(shlex.quote(a) for a in module_args)}"
    )
    ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", cfg.tpu_name, f"--zone={cfg.zone}"]
    if cfg.project:
        ssh.append(f"--project={cfg.project}")
    ssh.append("--worker=all")
    stop = [*ssh, f"--command=kill -TERM $(cat {pidfile} 2>/dev/null) 2>/dev/null; rm -f {pidfile}; true"]
    return [ProcessSpec("tpu-vm ssh", [*ssh, f"--command={remote}"], {})], stop


def start(
    cfg: LauncherConfig | None,
    module_args: Sequence[str],
    env: dict[str, str] | None = None,
    python: str | None = None,
    stay: bool = False,
    scope: str = "",
) -> Launched:
    """Start the stage's processes, each in its own process group (so stop() reaches their
    children too), stdout and stderr piped. A local stage's worker is the one started ahead
    (start_ahead), or the one a stage before left waiting (park), when there is one for the same
    interpreter, environment and folder. `stay`: another worker stage follows, so a local worker
    stays for it once this one ended well (grpo_core.stages.ahead; see park). `scope`: whose
    worker started ahead it may take (the flow run's: see start_ahead)."""
    cfg = cfg or LauncherConfig()
    specs, stop_argv = plan(cfg, module_args, env, python)
    procs: list[subprocess.Popen] = []
    launched = Launched(cfg, specs, procs, stop_argv)
    local = cfg.kind is LauncherKind.LOCAL
    ahead = _take_ahead(specs[0], stay, scope) if local else None
    if ahead is not None:
        procs.append(ahead)
        return launched
    try:
        if local and stay and _is_worker(specs[0].argv):  # one that can stay: the worker of an ahead process
            [spec] = specs
            procs.append(_popen([*spec.argv[:2], AHEAD_MODULE], spec.env, stdin=subprocess.PIPE))
            with contextlib.suppress(OSError):  # it ended at once: its output says why
                _hand(procs[0], spec.argv, stay=True)
            return launched
        for spec in specs:
            procs.append(_popen(spec.argv, spec.env, stdin=subprocess.DEVNULL))
    except OSError as exc:
        launched.stop()
        raise ConfigError(f"pipeline.launcher kind {cfg.kind.value}: cannot start {spec.argv[0]!r}: {exc}") from None
    return launched


def _popen(argv: list[str], env: dict[str, str], stdin: int) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **env},
    )


# -- a worker started ahead, or one that stayed ----------------------------------------------------
# A local stage's worker spends about a second importing JAX, flax, Orbax and the trainer, then
# starts its backend and compiles. The readiness stage starts the first epoch's worker ahead
# (grpo_core.stages.ahead, the device checks as its first line), and a stage that knows another
# worker stage follows it (tasks.stages.train_epoch before the last epoch) runs in a worker that
# stays once its stage ended well (park). The next stage's worker is that process, given its
# command line on stdin. Only the same interpreter, the same
# environment (everything it holds: JAX reads some of it at import) and the same working folder
# qualify; anything else, or a process that is gone, is stopped and a fresh worker started.
AHEAD_MODULE = "grpo_core.stages.ahead"
WORKER_MODULE = "grpo_core.stages.worker"
# At most one per scope (a flow run: tasks.process.ahead_scope), so that two flow runs in one
# process (grpo serve --limit 2, a readiness and a pipeline deployment at once) never take or stop
# each other's: {scope: (_ahead_key, the process)}.
_AHEAD: dict[str, tuple[tuple, subprocess.Popen]] = {}
# reentrant: a Ctrl-C handler (tasks.process.request_interrupt) may drop it while this thread holds it
_AHEAD_LOCK = threading.RLock()


def _ahead_key(python: str, env: dict[str, str]) -> tuple:
    return python, tuple(sorted({**os.environ, **env}.items())), os.getcwd()


def _swap_ahead(scope: str, *entry: tuple[tuple, subprocess.Popen]) -> list[tuple[tuple, subprocess.Popen]]:
    """Put `entry` (or nothing) where `scope`'s worker started ahead is kept; what was there."""
    with _AHEAD_LOCK:
        old = [_AHEAD.pop(scope)] if scope in _AHEAD else []
        if entry:
            [_AHEAD[scope]] = entry
    return old


def start_ahead(
    cfg: LauncherConfig | None,
    env: dict[str, str] | None = None,
    python: str | None = None,
    first: dict | None = None,
    scope: str = "",
) -> subprocess.Popen | None:
    """Start the worker of the next local stage now (stopping one `scope` started earlier) and
    return it; nothing for another launcher kind, which starts its processes elsewhere. `first`: a
    line for it to act on before it waits for its stage (the readiness checks:
    grpo_core.stages.ahead). `scope`: whose it is (a flow run); only that scope's stages take it."""
    cfg = cfg or LauncherConfig()
    if cfg.kind is not LauncherKind.LOCAL:
        return None
    [spec], _ = plan(cfg, [AHEAD_MODULE], env, python)
    proc = _popen(spec.argv, spec.env, stdin=subprocess.PIPE)
    _stop_ahead(_swap_ahead(scope, (_ahead_key(spec.argv[0], spec.env), proc)))
    if first is not None:
        try:
            proc.stdin.write(json.dumps(first) + "\n")
            proc.stdin.flush()
        except OSError:  # it ended at once: its caller reads why from its output
            pass
    return proc


def drop_ahead(scope: str) -> None:
    """Stop `scope`'s worker started ahead, if any (its pipeline ended, or no stage follows)."""
    _stop_ahead(_swap_ahead(scope))


def drop_all_ahead() -> None:
    """Stop every worker started ahead in this process (Ctrl-C, the process's exit)."""
    with _AHEAD_LOCK:
        old = list(_AHEAD.values())
        _AHEAD.clear()
    _stop_ahead(old)


def park(launched: Launched, scope: str = "") -> None:
    """Keep a local stage's worker that stayed (it printed stage_end) for the next stage, as a
    worker started ahead is kept: the next local stage with the same interpreter, environment
    and folder runs in it; anything else, or the pipeline's end, stops it (drop_ahead). Its
    stage is over and written, so stopping it loses nothing."""
    [spec], [proc] = launched.specs, launched.procs
    _stop_ahead(_swap_ahead(scope, (_ahead_key(spec.argv[0], spec.env), proc)))


def _is_worker(argv: list[str]) -> bool:
    return argv[1:3] == ["-m", WORKER_MODULE]


def _hand(proc: subprocess.Popen, argv: list[str], stay: bool) -> None:
    """Give a waiting worker its stage: the worker's arguments; stdin stays open when it is to stay."""
    proc.stdin.write(json.dumps({"argv": argv[3:], "stay": stay}) + "\n")
    proc.stdin.flush()
    if not stay:
        proc.stdin.close()


def _take_ahead(spec: ProcessSpec, stay: bool = False, scope: str = "") -> subprocess.Popen | None:
    """`scope`'s worker started ahead (or parked), given `spec`'s command line, when it can run
    `spec`; else None (and it is stopped)."""
    old = _swap_ahead(scope)
    if not old:
        return None
    [(key, proc)] = old
    argv = spec.argv
    if _is_worker(argv) and key == _ahead_key(argv[0], spec.env) and proc.poll() is None:
        try:
            _hand(proc, argv, stay)
            return proc
        except OSError:  # it ended meanwhile
            pass
    _stop_ahead(old)
    return None


def _stop_ahead(entries: list[tuple[tuple, subprocess.Popen]]) -> None:
    """A process started ahead has done nothing yet, and a parked one has written all its stage
    wrote and waits: either is killed, not asked to save."""
    for _, proc in entries:
        if proc.poll() is None:
            signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(OSError):
            proc.stdin.close()
        # a parked worker's output may still be read (tasks.process), and closing a stream blocks
        # while a read holds it: closed aside, once that read has met the end the kill made
        threading.Thread(target=_close_output, args=(proc,), daemon=True).start()


def _close_output(proc: subprocess.Popen) -> None:
    for stream in (proc.stdout, proc.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.close()


atexit.register(drop_all_ahead)


# -- the Ray driver --------------------------------------------------------------------------------


def _die_with_parent():
    """A preexec_fn that makes the worker get SIGKILL when the Ray task that started it dies
    (Linux; None elsewhere). libc is loaded here, in the parent: the child only calls prctl."""
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _host_task(index: int, count: int, coordinator: str, module_args: list[str], env: dict[str, str], lines=None):
    """One host's share (a Ray task): run the worker as process `index` of `count`; process 0's
    stdout lines go to `lines` (a ray.util.queue.Queue). Returns (exit code, stderr tail)."""
    full = {
        **os.environ,
        **env,
        ENV_COORDINATOR: coordinator,
        ENV_NUM_PROCESSES: str(count),
        ENV_PROCESS_ID: str(index),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", *module_args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full,
        preexec_fn=_die_with_parent(),
    )
    tail: collections.deque[str] = collections.deque(maxlen=40)
    t = threading.Thread(target=lambda: [tail.append(x.rstrip("\n")) for x in proc.stderr], daemon=True)
    t.start()
    for line in proc.stdout:
        if lines is not None:
            lines.put(line.rstrip("\n"))
    code = proc.wait()
    t.join(timeout=5)
    return code, "\n".join(tail)


def _node_ip() -> str:
    import ray  # optional (the ray extra): only the ray launcher needs it

    return ray.util.get_node_ip_address()


LOCAL_OBJECT_STORE_BYTES = 256 * 2**20  # address local: the driver's own instance moves exit codes and log lines


def _own_local_instance(hosts: int, resources: dict[str, float]) -> dict[str, Any]:
    """ray.init's arguments for the Ray instance this driver starts itself (address local: tests, one
    machine), and its environment, which every process of the instance inherits: on 127.0.0.1 only;
    a small object store (Ray's default is 30% of the machine's memory); enough CPUs for the hosts'
    bundles however few the machine has; no usage statistics; and an authentication token of its own
    in the environment, where Ray would otherwise write one to ~/.ray/auth_token."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not any(os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = uuid.uuid4().hex
    cpus = max(os.cpu_count() or 1, math.ceil(hosts * float(resources.get("CPU", 0))))
    return {"_node_ip_address": "127.0.0.1", "object_store_memory": LOCAL_OBJECT_STORE_BYTES, "num_cpus": cpus}


def _failure(index: int, count: int, code: int, tail: str, how: str | None = None) -> str:
    """How the driver reports a failed process on stderr: its stderr tail, then one line naming it
    (last, so that the caller's tail of the driver's stderr keeps it)."""
    how = how or (f"was killed by signal {-code}" if code < 0 else f"exited with code {code}")
    return "\n".join([*([tail] if tail else []), f"process {index} of {count} {how}"])


def _exit(rc: int) -> None:
    """Exit as the failed process did: with its code, or killed by its signal (sys.exit(-9) would
    read as code 247), so the caller tells a kill (worth a retry) from a worker's own exit code."""
    if rc < 0:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            signal.signal(-rc, signal.SIG_DFL)  # SIGKILL and SIGSTOP cannot be caught, nor set
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), -rc)
        sys.exit(128 - rc)  # a signal whose default is not to end a process: the shell's code for it
    sys.exit(rc)


def ray_main(argv: Sequence[str]) -> int:
    """`python -m grpo_core.launch.launchers ray ... -- grpo_core.stages.worker train ...`: one task per host in a
    placement group, the coordinator on host 0; relays process 0's stdout; returns the first
    failing process's code (negative: killed by that signal; its stderr tail on stderr), after
    cancelling the others. Ray is shut down before it returns (address local: the instance stops)."""
    ap = argparse.ArgumentParser(prog="python -m grpo_core.launch.launchers ray")
    ap.add_argument("--address", default="auto")
    ap.add_argument("--hosts", type=int, required=True)
    ap.add_argument("--port", type=int, default=8476)
    ap.add_argument("--strategy", default="STRICT_SPREAD")
    ap.add_argument("--resources", default='{"CPU": 1}')
    ap.add_argument("--env", default="{}")
    ap.add_argument("module_args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    module_args = args.module_args[1:] if args.module_args[:1] == ["--"] else args.module_args
    env, resources = json.loads(args.env), json.loads(args.resources)
    init_kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if args.address == "local":
        init_kw.update(_own_local_instance(args.hosts, resources))
    import ray  # optional (the ray extra)

    ray.init(address=args.address, **init_kw)
    try:  # however _drive ends (an error too): no task left running; address local: the instance stopped
        return _drive(args, module_args, env, resources)
    finally:
        ray.shutdown()


def _drive(args: argparse.Namespace, module_args: list[str], env: dict[str, str], resources: dict[str, Any]) -> int:
    import ray  # optional (the ray extra)
    from ray.util.placement_group import placement_group  # optional, as ray
    from ray.util.queue import Empty, Queue  # optional, as ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # optional, as ray

    pg = placement_group([dict(resources) for _ in range(args.hosts)], strategy=args.strategy)
    wait_s = float(env.get(ENV_INIT_TIMEOUT, 300))
    try:
        ray.get(pg.ready(), timeout=wait_s)
    except ray.exceptions.GetTimeoutError:
        print(
            f"the Ray cluster at {args.address} found no room for {args.hosts} hosts with {resources} each "
            f"({args.strategy}) within {wait_s:g} s: {ray.cluster_resources()}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    on = lambda i: PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
    res = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    task_kw = lambda i: dict(
        scheduling_strategy=on(i),
        num_cpus=resources.get("CPU", 0),
        num_gpus=resources.get("GPU", 0),
        resources=res or None,
    )
    ip = ray.get(ray.remote(_node_ip).options(**task_kw(0)).remote())
    coordinator = f"{ip}:{args.port}"
    lines = Queue()
    host = ray.remote(max_retries=0)(_host_task)
    refs = [
        host.options(**task_kw(i)).remote(i, args.hosts, coordinator, module_args, env, lines if i == 0 else None)
        for i in range(args.hosts)
    ]
    index = {r: i for i, r in enumerate(refs)}

    def relay():
        while True:
            try:
                print(lines.get(block=False), flush=True)
            except Empty:
                return

    pending, rc = list(refs), 0
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=0.5)
        relay()
        for r in done:
            how = None
            try:
                code, tail = ray.get(r)
            except ray.exceptions.RayError as exc:  # the task itself failed: its Ray worker or node died
                code, tail, how = 1, str(exc)[-2000:], f"lost its Ray task ({type(exc).__name__})"
            if code != 0:
                print(_failure(index[r], args.hosts, code, tail, how), file=sys.stderr, flush=True)
                for other in pending:
                    ray.cancel(other, force=True)
                pending, rc = [], code
                break
    relay()
    return rc


if __name__ == "__main__":
    if sys.argv[1:2] != ["ray"]:
        sys.exit("usage: python -m grpo_core.launch.launchers ray --hosts N [...] -- MODULE ARGS...")
    _exit(ray_main(sys.argv[2:]))
