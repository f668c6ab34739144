"""The split layout's learner side (train.rollout.layout=split): the rollout in a second local JAX
process (grpo_core.stages.rollout) on CPU cores of its own, the messages between the two, and the
errors it may end with (grpo_core.rl.overlap has the schedule both layouts share)."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

from grpo_core import errors
from grpo_core.errors import RolloutError
from grpo_core.launch.processes import ENV_ROLLOUT_CORES, ENV_ROLLOUT_PARENT
from grpo_core.rl.overlap import Made, _Ahead
from grpo_core.store.lease import process_alive


def learner_and_rollout_cores(rollout_cfg) -> tuple[list[int], list[int]]:
    """This process's CPU cores split in two: (the learner's, the rollout process's), as
    train.rollout.devices says (RolloutConfig.split_counts)."""
    cores = sorted(os.sched_getaffinity(0))
    learner, _ = rollout_cfg.split_counts(len(cores), "CPU cores this process may use")
    return cores[:learner], cores[learner:]


def pin_process(cores: list[int]) -> list[int]:
    """Every thread of this process onto `cores` (threads started later inherit it); what the
    calling thread had before. XLA:CPU's threads already run, so each one is moved."""
    before = sorted(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, OSError):  # a thread that ended since the listing
            pass
    return before


ROLLOUT_MODULE = "grpo_core.stages.rollout"
# The rollout process's log in the system's temp folder, grpo-rollout-{learner pid}-xxxx.log: deleted
# when it ends well; kept when it fails (its tail is in the error), until a later split stage finds
# its learner gone (a retry, a SIGKILLed worker's next run)
LOG_PREFIX = "grpo-rollout-"


def remove_dead_logs(temp_dir: str | None = None) -> list[str]:
    """Delete the rollout logs whose learner process is gone; the files deleted."""
    removed = []
    base = temp_dir or tempfile.gettempdir()
    for name in os.listdir(base):
        pid = name[len(LOG_PREFIX) :].split("-", 1)[0]
        if not (name.startswith(LOG_PREFIX) and name.endswith(".log") and pid.isdigit()) or _alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(base, name))
            removed.append(os.path.join(base, name))
        except OSError:  # another stage's sweep took it first
            pass
    return removed


def _alive(pid: int) -> bool:
    return process_alive(pid, None)  # a zombie (killed, not yet reaped) is gone too


_SENDING = threading.Lock()  # a process's messages go out whole, whichever thread sends


def send(conn: Connection, message: Any) -> None:
    data = pickle.dumps(message, protocol=5)
    with _SENDING:
        conn.send_bytes(data)


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


class Split(_Ahead):
    """The rollout in a second local process (python -m grpo_core.stages.rollout) on CPU cores of
    its own. It starts with this object (its imports and its reading of the run run while the
    learner restores), is handed the starting version at `start` and every later one by `publish`
    (`to_host`: the learner's parameters as numpy, LoRA merged), and sends its batches back.

    It is a worker like any other, whose one owner is the learner: in a session of its own (a Ctrl-C
    or a stage's stop reaches the worker, which saves a checkpoint with this process's batches and
    then stops it), ended by the kernel when the thread that started it ends however it ends
    (PR_SET_PDEATHSIG: build the trainer in the thread that trains), ended by its socket's end,
    stopped by `close`. A failure is raised here as the same error (a reward function's error is
    not retried), or as RolloutError naming the process and its log (a crash or a kill: retried,
    and the retry resumes from the checkpoint)."""

    def __init__(
        self,
        argv: list[str],
        k: int,
        to_host: Callable,
        on_shape: Callable[[tuple[int, ...]], None],
        model_config,
        rollout_cfg,
    ):
        super().__init__(k)
        self.to_host, self.on_shape, self.model_config = to_host, on_shape, model_config
        self.learner_cores, self.rollout_cores = learner_and_rollout_cores(rollout_cfg)
        self._affinity = pin_process(self.learner_cores)
        ours, theirs = socket.socketpair()
        remove_dead_logs()
        fd, self.log_path = tempfile.mkstemp(prefix=f"{LOG_PREFIX}{os.getpid()}-", suffix=".log")
        env = {
            **os.environ,
            ENV_ROLLOUT_CORES: ",".join(map(str, self.rollout_cores)),
            ENV_ROLLOUT_PARENT: str(os.getpid()),
            "PYTHONUNBUFFERED": "1",
        }
        with os.fdopen(fd, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", ROLLOUT_MODULE, *argv, "--fd", str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(theirs.fileno(),),
                env=env,
                start_new_session=True,
            )
        theirs.close()
        self.conn = Connection(os.dup(ours.fileno()))
        ours.close()
        self.closing = False
        self.info: dict[str, Any] = {}
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True, name="rollout-reader").start()

    @property
    def what(self) -> str:
        return f"the rollout process (pid {self.proc.pid}, python -m {ROLLOUT_MODULE}; its log {self.log_path})"

    def start(self, step: int, params, held: list[Made], end: int) -> None:
        first = self.first_to_draw(step, held, end)
        hello = {"first": first, "end": end, "k": self.k, "version": step, "model_config": self.model_config}
        self._send(("start", hello))
        self.publish(step, params, force=True)
        self.started = True

    def publish(self, version: int, params, force: bool = False) -> None:
        if version < self.end or force:
            self._send(("version", version, self.to_host(params)))

    def _send(self, message) -> None:
        try:
            send(self.conn, message)
        except OSError as exc:  # its end is closed: it has exited, and the reader says why
            self.inbox.fail(RolloutError(f"{self.what} no longer reads: {exc}"))

    def _read(self) -> None:
        while True:
            try:
                kind, *body = receive(self.conn)
            except (EOFError, OSError):
                if not self.closing:
                    self.inbox.fail(RolloutError(f"{self.what} {self._ended()}{self._tail()}"))
                return
            if kind == "made":
                self.inbox.put(body[0])
            elif kind == "shape":
                self.on_shape(body[0])
            elif kind == "ready":
                self.info = body[0]
                self.ready.set()
            elif kind == "error":
                self.inbox.fail(_as_error(body[0], self.what))

    def _ended(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "closed its socket but still runs"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def _tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
        except OSError:
            return ""
        return (": ..." + "\n".join(tail)[-3000:]) if tail else ""

    def close(self) -> None:
        """Stop the process (a message, then SIGKILL after 5 s) and give the learner its cores back."""
        self.closing = True
        try:
            send(self.conn, ("stop",))
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        pin_process(self._affinity)
        if self.proc.returncode in (0, -signal.SIGKILL) and self.inbox._error is None:
            os.unlink(self.log_path)


# The errors the rollout process may end with, raised here as themselves (their exit codes and
# retry rules stay theirs); anything else is a RolloutError (retried).
_PASSED = {
    cls.__name__: cls
    for cls in (
        errors.ConfigError,
        errors.DataError,
        errors.RewardFunctionError,
        errors.RewardTimeout,
        errors.NonFiniteError,
        errors.RolloutError,
        errors.RolloutTimeout,
        errors.StorageError,
        errors.LastingStorageError,
        MemoryError,
    )
}


def _as_error(report: dict[str, Any], what: str) -> BaseException:
    cls = _PASSED.get(report["type"])
    if cls is None:
        return RolloutError(f"{what} failed: {report['type']}: {report['message']}")
    return cls(f"{report['message']} (in {what})")


def error_report(exc: BaseException) -> dict[str, Any]:
    """What the rollout process sends before it exits with an error: its class and message."""
    return {"type": type(exc).__name__, "message": str(exc)}
