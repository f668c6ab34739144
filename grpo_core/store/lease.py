"""The owner of a run root: a lease object, `{run}/lease.json`, that one pipeline run holds while
it trains and evaluates, so that a second run of the same root is refused instead of training the
same steps beside it (and deleting the first one's checkpoints under it).

    with RunLease(run_url, ttl_s=120, flow_run_id=...) as lease:   # LeaseHeld: another run owns it
        ...
        lease.check()   # between stages: LeaseLost once another run has taken the root over

The lease says who holds it (an owner token, the host, pid and the pid's start time, the Prefect
flow run id if any), when it was taken and when its heartbeat last renewed it, and its ttl. A
thread renews it every ttl/4. Every write is a compare-and-swap against the version that was read,
so of two contenders exactly one wins:

- gs://: object generations. Create with ifGenerationMatch=0, renew, take over and delete with
  ifGenerationMatch=<the generation read>; real GCS answers 412 to a stale one (tests/gcs.py makes
  the emulator do the same).
- a local folder: an exclusive flock on the run root folder around read-compare-write (the lock
  dies with its process, so a kill -9 never leaves it held), a new lease linked into place (an
  O_EXCL create that is visible only whole), a renewal or take-over written beside it and renamed
  over it. The version is a hash of the bytes (each write holds a fresh token and count).
- any other filesystem (memory://): the same under a lock of this process.

Another run may take a lease over when its heartbeat is older than its ttl (the owner crashed or
hangs), at once when the owner ran on this machine and its process is gone (its pid is not alive,
or is alive with another start time: a reused pid), and at once when it is a retry of the same
Prefect flow run. Otherwise the contender gets LeaseHeld naming the owner, the age of its
heartbeat and when it expires. An owner whose lease was taken over (its version moved) stops
claiming it, logs so loudly and fails its next check() with LeaseLost; release() deletes the
object only while it is still this owner's.

Times are each writer's wall clock (time.time()): hosts sharing a run root need clocks that agree
to well within the ttl.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any
from urllib.parse import quote

from grpo_core.errors import RunRootInUse, StorageError
from grpo_core.store.root import RunRoot, describe_storage_error

LEASE = "lease.json"
DEFAULT_TTL_S = 120.0
_FIELDS = ("owner", "host", "pid", "acquired_at", "heartbeat_at", "ttl_s")

_log = logging.getLogger(__name__)


class LeaseHeld(RunRootInUse):
    """Another run holds the run root's lease; the message names it and what to do."""


class LeaseLost(RunRootInUse):
    """This run's lease was taken over (or deleted): the run root is no longer this run's."""


class _Conflict(Exception):  # noqa: N818 - internal: a compare-and-swap found another version
    pass


# -- this machine and its processes -----------------------------------------------------------------


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _pid_ns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]": a container has its own
    except OSError:
        return None


def host_identity() -> dict[str, Any]:
    """What makes a pid in a lease comparable with this machine's: the host name, the kernel's boot
    id (a reboot, or another kernel with the same host name, differs) and the pid namespace."""
    return {"host": socket.gethostname(), "boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pid_ns": _pid_ns()}


def process_start(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot, from /proc), so that a reused pid
    is told apart; None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after "(comm)", which may hold spaces
    except (OSError, IndexError):
        return None
    return fields[19].decode() if len(fields) > 19 else None  # field 22, starttime


def process_alive(pid: int, start: str | None) -> bool:
    """Whether the process that wrote a lease on this machine still runs: pid `pid`, alive, not a
    zombie, and (where both are known) started at `start`. Unsure is alive."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:  # no /proc (macOS): only "no such process" is sure
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True
    if fields and fields[0] in (b"Z", b"X"):  # killed, not yet reaped
        return False
    return not (start and len(fields) > 19 and fields[19].decode() != start)


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def describe_owner(rec: dict[str, Any]) -> str:
    return f"host {rec.get('host')}, pid {rec.get('pid')}, flow run {rec.get('flow_run_id') or '(none)'}"


# -- compare-and-swap on one object -------------------------------------------------------------------


class _LocalBackend:
    """lease.json in a local folder; every change under an exclusive flock of the folder."""

    def __init__(self, folder: str):
        self.folder = folder
        self.path = os.path.join(folder, LEASE)

    def read(self) -> tuple[bytes | None, str | None]:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None, None
        return data, hashlib.sha256(data).hexdigest()

    @contextlib.contextmanager
    def _locked(self):
        os.makedirs(self.folder, exist_ok=True)
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            import fcntl  # POSIX only: the lease module itself imports anywhere

            fcntl.flock(fd, fcntl.LOCK_EX)  # per open file: threads of one process exclude each other too
            yield
        finally:
            os.close(fd)  # and with it the lock

    def _temp(self, data: bytes) -> str:
        tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _expect(self, gen: str | None) -> None:
        if self.read()[1] != gen:
            raise _Conflict

    def create(self, data: bytes) -> str:
        with self._locked():
            tmp = self._temp(data)
            try:
                os.link(tmp, self.path)  # O_EXCL's guarantee, and never seen half written
            except FileExistsError:
                raise _Conflict from None
            finally:
                os.unlink(tmp)
        return hashlib.sha256(data).hexdigest()

    def replace(self, data: bytes, gen: str) -> str:
        with self._locked():
            self._expect(gen)
            tmp = self._temp(data)
            try:
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        return hashlib.sha256(data).hexdigest()

    def delete(self, gen: str) -> None:
        with self._locked():
            self._expect(gen)
            os.unlink(self.path)


class _GcsBackend:
    """lease.json on GCS; every change conditional on the object generation (JSON API, via gcsfs's
    request helper: its pipe/rm do not pass preconditions)."""

    def __init__(self, fs: Any, path: str):
        self.fs, self.path = fs, path
        self.bucket, self.key, _ = fs.split_path(path)

    def read(self) -> tuple[bytes | None, str | None]:
        try:
            headers, data = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, alt="media")
        except FileNotFoundError:
            return None, None
        gen = headers.get("x-goog-generation")
        if not gen:
            raise StorageError(f"gs://{self.path}: the server sent no x-goog-generation with the object")
        return data, gen

    def _upload(self, data: bytes, if_gen: str) -> str:
        """One multipart upload (metadata, then the bytes), as gcsfs's own small writes are."""
        boundary = f"==lease-{uuid.uuid4().hex}=="
        meta = json.dumps({"name": self.key, "contentType": "application/json"})
        body = (
            (
                f"--{boundary}\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n"
                f"--{boundary}\nContent-Type: application/json\n\n"
            ).encode()
            + data
            + f"\n--{boundary}--".encode()
        )
        try:
            obj = self.fs.call(
                "POST",
                f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o",
                uploadType="multipart",
                ifGenerationMatch=if_gen,
                headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
                data=body,
                json_out=True,
            )
        except FileExistsError:  # 412 Precondition Failed
            raise _Conflict from None
        finally:
            self.fs.invalidate_cache(self.path)
        return str(obj["generation"])

    def create(self, data: bytes) -> str:
        return self._upload(data, "0")

    def replace(self, data: bytes, gen: str) -> str:
        return self._upload(data, gen)

    def delete(self, gen: str) -> None:
        try:
            self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key, ifGenerationMatch=gen)
        except (FileExistsError, FileNotFoundError):
            raise _Conflict from None
        finally:
            self.fs.invalidate_cache(self.path)


class _FsBackend:
    """Any other fsspec filesystem (memory:// in tests): compare-and-swap under a lock of this
    process, which is exact for memory:// and only best effort between processes elsewhere."""

    _lock = threading.Lock()

    def __init__(self, fs: Any, path: str):
        self.fs, self.path = fs, path

    def read(self) -> tuple[bytes | None, str | None]:
        try:
            data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None, None
        return data, hashlib.sha256(data).hexdigest()

    def create(self, data: bytes) -> str:
        with self._lock:
            if self.read()[0] is not None:
                raise _Conflict
            self.fs.pipe_file(self.path, data)
        return hashlib.sha256(data).hexdigest()

    def replace(self, data: bytes, gen: str) -> str:
        with self._lock:
            if self.read()[1] != gen:
                raise _Conflict
            self.fs.pipe_file(self.path, data)
        return hashlib.sha256(data).hexdigest()

    def delete(self, gen: str) -> None:
        with self._lock:
            if self.read()[1] != gen:
                raise _Conflict
            self.fs.rm_file(self.path)


def _backend(root: RunRoot) -> Any:
    protocols = root.fs.protocol if isinstance(root.fs.protocol, tuple) else (root.fs.protocol,)
    path = root._p(LEASE)
    if root._local:
        return _LocalBackend(root.path)
    if {"gs", "gcs"} & set(protocols):
        return _GcsBackend(root.fs, path)
    if "memory" not in protocols:
        _log.warning(
            "%s: no compare-and-swap on %s; its lease excludes runs of this process only", root.url, protocols[0]
        )
    return _FsBackend(root.fs, path)


# -- the lease ----------------------------------------------------------------------------------------


class RunLease:
    """The lease of one run root for one holder (see the module docstring). `flow_run_id`: the
    Prefect flow run this holder runs in, so that a retry of that flow run takes its own lease over
    at once; `heartbeat_s`: seconds between renewals (ttl/4 by default)."""

    def __init__(
        self,
        run_url: str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        flow_run_id: str | None = None,
        heartbeat_s: float | None = None,
        logger: logging.Logger | logging.LoggerAdapter | None = None,
    ):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.root = RunRoot(run_url)
        self.url = self.root.url
        self.uri = self.root.uri(LEASE)
        self.ttl_s = float(ttl_s)
        self.heartbeat_s = float(heartbeat_s) if heartbeat_s else self.ttl_s / 4
        self.flow_run_id = str(flow_run_id) if flow_run_id else None
        self.token = uuid.uuid4().hex
        self.log = logger or _log
        self._backend = _backend(self.root)
        self._lock = threading.RLock()  # one backend operation of this holder at a time
        self._gen: str | None = None
        self._record: dict[str, Any] | None = None
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewed = 0.0  # time.monotonic() of the last write that held

    # -- what is there ----------------------------------------------------------------------------

    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        try:
            data, gen = self._backend.read()
        except OSError as exc:
            raise StorageError(describe_storage_error(self.uri, exc)) from exc
        if data is None:
            return None, None
        try:
            rec = json.loads(data)
            missing = [k for k in _FIELDS if k not in rec] if isinstance(rec, dict) else list(_FIELDS)
            if missing:
                raise ValueError(f"no {', '.join(missing)}")
            float(rec["heartbeat_at"]), float(rec["ttl_s"]), int(rec["pid"])
        except (ValueError, TypeError) as exc:
            raise LeaseHeld(
                f"run root {self.url} has a lease this program cannot read ({self.uri}: {exc}); "
                "if no run uses this run root, delete it; otherwise choose another run_name or storage.root"
            ) from None
        return rec, gen

    def current(self) -> dict[str, Any] | None:
        """The lease record in the run root now (None: no lease)."""
        return self._read()[0]

    def _takeover_reason(self, rec: dict[str, Any], now: float) -> str | None:
        """Why `rec` (another holder's) may be taken over now, or None while it is live."""
        age = now - float(rec["heartbeat_at"])
        if age > float(rec["ttl_s"]):
            return f"its heartbeat is {_ago(age)} old, past its ttl of {float(rec['ttl_s']):.0f} s"
        if self.flow_run_id and rec.get("flow_run_id") == self.flow_run_id:
            return f"it is an earlier attempt of this flow run ({self.flow_run_id})"
        me = host_identity()
        if all(rec.get(k) == me[k] for k in me):  # the same machine (and pid namespace)
            pid = int(rec["pid"])
            if pid == os.getpid() and rec.get("pid_start") == process_start(pid):
                return None  # this very process: another holder object here owns it
            if not process_alive(pid, rec.get("pid_start")):
                return f"its process (pid {pid} on this host) is gone"
        return None

    def refusal(self, rec: dict[str, Any], now: float | None = None) -> LeaseHeld:
        """The error a contender gets while `rec` is live."""
        now = time.time() if now is None else now
        heartbeat, ttl = float(rec["heartbeat_at"]), float(rec["ttl_s"])
        expires = heartbeat + ttl
        return LeaseHeld(
            f"run root {self.url} is in use by another run: {describe_owner(rec)} "
            f"(its lease {self.uri}, taken {_ago(now - float(rec['acquired_at']))} ago). "
            f"Its heartbeat is {_ago(now - heartbeat)} old; unless renewed the lease expires in "
            f"{_ago(expires - now)}, at {_utc(expires)} (ttl {ttl:.0f} s). Wait for that run to finish "
            "(if it crashed, its lease expires by then and a retry takes the run root over), or give "
            "this run another run_name or storage.root."
        )

    def raise_if_held(self) -> None:
        """LeaseHeld if another run holds the lease now and may not be taken over. Reads only: a
        run that is refused writes nothing into the run root."""
        rec, _ = self._read()
        if rec is not None and rec["owner"] != self.token and self._takeover_reason(rec, time.time()) is None:
            raise self.refusal(rec)

    # -- holding it ---------------------------------------------------------------------------------

    @property
    def held(self) -> bool:
        return self._gen is not None and self._lost is None

    @property
    def lost(self) -> str | None:
        """Why this holder lost its lease (None: it has not)."""
        return self._lost

    @property
    def record(self) -> dict[str, Any] | None:
        """The record as this holder last wrote it."""
        return dict(self._record) if self._record else None

    def _body(self, acquired_at: float | None, renewals: int) -> dict[str, Any]:
        now, pid = time.time(), os.getpid()
        return {
            "owner": self.token,
            **host_identity(),
            "pid": pid,
            "pid_start": process_start(pid),
            "flow_run_id": self.flow_run_id,
            "acquired_at": now if acquired_at is None else acquired_at,
            "heartbeat_at": now,
            "expires_at": now + self.ttl_s,
            "ttl_s": self.ttl_s,
            "renewals": renewals,
            "run_url": self.url,
        }

    @staticmethod
    def _encode(rec: dict[str, Any]) -> bytes:
        return json.dumps(rec, indent=1, sort_keys=True).encode()

    def acquire(self) -> RunLease:
        """Take the lease (or take it over, see the module docstring) and start the heartbeat;
        LeaseHeld if another run holds it."""
        with self._lock:
            if self.held:
                return self
            if self._lost:
                raise LeaseLost(self._lost)
            for _ in range(20):  # each turn lost to a contender re-reads what it wrote
                rec, gen = self._read()
                if rec is not None and rec["owner"] == self.token:  # a write whose answer got lost
                    self._record, self._gen = rec, gen
                    break
                body = self._body(None, 0)
                try:
                    if rec is None:
                        self._gen = self._backend.create(self._encode(body))
                    else:
                        reason = self._takeover_reason(rec, time.time())
                        if reason is None:
                            raise self.refusal(rec)
                        self._gen = self._backend.replace(self._encode(body), gen)
                        self.log.warning("took over the run root %s from %s: %s", self.url, describe_owner(rec), reason)
                except _Conflict:
                    continue
                except OSError as exc:
                    raise StorageError(f"cannot write {self.uri}: {exc}") from exc
                self._record = body
                break
            else:
                raise StorageError(f"{self.uri} kept changing under 20 attempts to take it; try again")
            self._renewed = time.monotonic()
        self.log.info("holding the run root %s (lease %s, ttl %.0f s)", self.url, self.uri, self.ttl_s)
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name=f"lease {self.url}", daemon=True)
        self._thread.start()
        return self

    def _read_theirs(self) -> tuple[dict[str, Any] | None, str | None]:
        """_read, where an unreadable lease (someone wrote over ours) counts as not ours."""
        try:
            return self._read()
        except LeaseHeld as exc:
            raise self._mark_lost(None, why=f"its lease was overwritten: {exc}") from None

    def _mark_lost(self, rec: dict[str, Any] | None, why: str | None = None) -> LeaseLost:
        if why is None and rec is None:
            why = f"its lease {self.uri} was deleted"
        elif why is None:
            why = f"it was taken over by {describe_owner(rec)} (lease {self.uri})"
        lost = (
            f"run root {self.url} is no longer this run's: {why}. This run starts no further stage there: the "
            "stage running now ends as it would (its worker may still write a checkpoint, metrics or an evaluation "
            "until it does), then the run stops; the run that holds the root now carries on"
        )
        self._stop.set()
        self.log.error("LEASE LOST: %s", lost)
        self._lost = lost
        return LeaseLost(lost)

    def renew(self) -> None:
        """Write a fresh heartbeat (the heartbeat thread calls this); LeaseLost if another run holds
        the lease now."""
        with self._lock:
            if self._lost:
                raise LeaseLost(self._lost)
            if self._gen is None or self._record is None:
                raise RuntimeError(f"{self.uri}: renew() before acquire()")
            body = self._body(float(self._record["acquired_at"]), int(self._record.get("renewals", 0)) + 1)
            try:
                self._gen = self._backend.replace(self._encode(body), self._gen)
                self._record = body
            except _Conflict:
                rec, gen = self._read_theirs()
                if rec is None or rec["owner"] != self.token:
                    raise self._mark_lost(rec) from None
                self._record, self._gen = rec, gen  # our own write, whose answer got lost
            except OSError as exc:
                raise StorageError(f"cannot renew {self.uri}: {exc}") from exc
            self._renewed = time.monotonic()

    def _heartbeat(self) -> None:
        warned = False
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.renew()
                warned = False
            except LeaseLost:
                return
            except Exception as exc:  # noqa: BLE001 - storage trouble: try again next beat
                stale = time.monotonic() - self._renewed
                if stale > self.ttl_s and not warned:
                    warned = True
                    self.log.error(
                        "could not renew the lease of %s for %.0f s (ttl %.0f s): another run may take the "
                        "run root over; last error: %s",
                        self.url,
                        stale,
                        self.ttl_s,
                        exc,
                    )
                else:
                    self.log.warning("could not renew the lease of %s: %s", self.url, exc)

    def check(self) -> None:
        """LeaseLost unless this holder still holds the lease (reads the object: call it between
        stages, before writing into the run root)."""
        with self._lock:
            if self._lost:
                raise LeaseLost(self._lost)
            if self._gen is None:
                raise RuntimeError(f"{self.uri}: check() before acquire()")
            rec, gen = self._read_theirs()
            if gen != self._gen and (rec is None or rec["owner"] != self.token):
                raise self._mark_lost(rec)

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(self.ttl_s, 5.0))
        self._thread = None

    def release(self) -> bool:
        """Stop the heartbeat and delete the lease if it is still this holder's; True if deleted.
        Never raises for a lease another run holds now (it is theirs)."""
        self._stop_heartbeat()
        with self._lock:
            if self._gen is None or self._lost:
                return False
            gen, self._gen = self._gen, None
            try:
                try:
                    self._backend.delete(gen)
                except _Conflict:
                    rec, gen = self._read()
                    if rec is None or rec["owner"] != self.token:
                        self.log.warning(
                            "did not delete %s: it is no longer this run's (%s)",
                            self.uri,
                            describe_owner(rec) if rec else "deleted",
                        )
                        return False
                    self._backend.delete(gen)
            except (_Conflict, OSError, StorageError, RunRootInUse) as exc:
                self.log.warning("could not delete %s: %s (it expires after %.0f s)", self.uri, exc, self.ttl_s)
                return False
        self.log.info("released the run root %s", self.url)
        return True

    def __enter__(self) -> RunLease:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
