"""Local child processes: a free port to give one, and stopping one by its process group.

Every process this project starts and may have to stop (a stage's workers, grpo_core.launch.launchers;
a rollout server, grpo_core.engines.http) is started with `start_new_session=True`, so its pid is
also its process group's id and the group holds whatever it starts in turn. Stopping it is the
same loop everywhere: SIGTERM to the group, a grace period, then SIGKILL to what is left.

This module runs in the Prefect process too (grpo_core.launch is imported there): standard
library only, no JAX.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import subprocess
import time
from typing import Iterator, Sequence

# Set in a local worker's environment by the launcher: the worker stops when the process that
# started it ends, however it ends (kill -9 included), i.e. when the worker is re-parented.
ENV_WATCH_PARENT = "GRPO_STOP_WHEN_PARENT_EXITS"
# Set by the learner in the split layout's rollout process (grpo_core.rl.split, grpo_core.stages.rollout),
# read there before JAX loads: the CPU cores it runs on, and the learner's pid (it ends when that is gone)
ENV_ROLLOUT_CORES = "GRPO_ROLLOUT_CORES"
ENV_ROLLOUT_PARENT = "GRPO_ROLLOUT_PARENT"


@contextlib.contextmanager
def imports_without_gc() -> Iterator[None]:
    """For a process's start-up imports (JAX, flax, Orbax, Prefect): they build objects that live
    as long as the process, so the cyclic collector's passes over them free nothing and cost ~10 %
    of the imports' CPU time (a worker's: 1.52 -> 1.36 CPU-s). Collection is off while they run;
    what they built is then frozen out of later collections (gc.freeze), which would only walk it
    again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it; another process may take it
    before the caller binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def signal_group(pid: int, sig: int) -> bool:
    """Send `sig` to the process group `pid`; False when the group no longer exists."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _leader_running(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def _group_exists(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the leader: an exited but unreaped leader still counts as a member
    return signal_group(proc.pid, 0)


def stop_process_groups(procs: Sequence[subprocess.Popen], grace_s: float, *, whole_group: bool = False) -> None:
    """SIGTERM the process group of every process in `procs`, wait up to `grace_s` for each,
    then SIGKILL what is left and wait again.

    What is "left":
    - whole_group=False (a stage's workers): a group whose leader (the Popen itself) still runs;
      each leader is waited for up to grace_s. A group whose leader has exited is not signalled.
    - whole_group=True (a server whose children must go with it): a group with any member left,
      leader or not; each group is polled until it is empty, up to grace_s, and finally each
      leader is reaped, waiting up to grace_s (subprocess.TimeoutExpired if it outlives SIGKILL).
    """
    left = _group_exists if whole_group else _leader_running
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if left(p)]
        for p in alive:
            signal_group(p.pid, sig)
        for p in alive:
            if whole_group:
                deadline = time.monotonic() + grace_s
                while time.monotonic() < deadline and _group_exists(p):
                    time.sleep(0.1)
            else:
                try:
                    p.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    pass
    if whole_group:
        for p in procs:
            p.wait(timeout=grace_s)


def sglang_python(repo_root: str | None = None) -> str | None:
    """The sglang-jax environment's interpreter: GRPO_SGLANG_PYTHON, else .venv-sglang/bin/python
    of the project checkout (where `make sglang-env` builds it), else None."""
    env = os.environ.get("GRPO_SGLANG_PYTHON")
    if env:
        return env
    root = repo_root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, ".venv-sglang", "bin", "python")
    return path if os.path.exists(path) else None


# The host probes that must run before JAX (TPU chips here, JAX_PLATFORMS) live in grpo_core/__init__.py.
