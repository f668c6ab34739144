"""A run root addressed by URL: a local folder (default), `gs://bucket/prefix` (gcsfs), or
`memory://` for tests. One run = one folder; see the run-root layout in DESIGN.md.

Rules that make stages safe to retry: every object is written whole (GCS objects are
immutable: metrics go to new shards, never appends); a stage writes its outputs first and its
completion marker last, so a marker means the outputs are complete; a stage's outputs live
under a short hash of the config fields that matter to it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import math
import os
import posixpath
import re
import socket
import time
import urllib.parse
import uuid
from typing import Any

import fsspec

from grpo_core.config.fields import config_hash  # noqa: F401 - the stages' keys; importers keep it here
from grpo_core.errors import DamagedFile, StorageError

_log = logging.getLogger(__name__)


def strict(obj: Any) -> Any:
    """`obj` with every NaN and ±Inf float (NumPy's too) replaced by None, so that it is strict
    JSON: Python's json writes them as the bare words NaN and Infinity, which JSON has not, and
    which strict parsers (JavaScript, jq, Go, Prefect's API) refuse. A metric with no value (a
    step no reward scored, an accuracy over no scored row) is null in the run root."""
    if isinstance(obj, float):  # np.float64 too
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    if hasattr(obj, "dtype") and hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:  # a NumPy scalar
        return strict(obj.item())
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON (see `strict`): what every JSON object in a run root is written with."""
    return json.dumps(strict(obj), allow_nan=False, **kw)


# What a user can do about a storage fault, by its cause (see describe_storage_error).
CREDENTIALS_FIX = (
    "check that the bucket exists and that these credentials may write to it "
    "(GOOGLE_APPLICATION_CREDENTIALS, or gcloud auth application-default login)"
)


def exception_chain(exc: BaseException, limit: int = 8) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or during, outermost first."""
    chain, e = [], exc
    while e is not None and len(chain) < limit:
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def describe_storage_error(url: str, exc: BaseException) -> str:
    """One sentence on why `url` (under storage.root) cannot be used, and what to do: the cause
    read from the exception chain (no network, refused, permission, no space), not a raw
    ClientConnectorDNSError or the tail of a traceback."""
    chain = exception_chain(exc)
    text = " | ".join(f"{type(c).__name__}: {c}" for c in chain)
    errnos = {getattr(c, "errno", None) for c in chain}
    if errno.ENOSPC in errnos or errno.EDQUOT in errnos or "No space left on device" in text:
        why = "no space left on the device that holds it; free some space or choose another storage.root"
    elif errno.EROFS in errnos or "Read-only file system" in text:
        why = "the file system is read-only; choose another storage.root"
    elif errno.ENOTDIR in errnos or any(isinstance(c, NotADirectoryError) for c in chain):
        why = "a path in it is a file, not a folder; choose another storage.root"
    elif any(isinstance(c, PermissionError) for c in chain) or " 403" in text or "Forbidden" in text:
        local = "://" not in url or url.startswith("file://")  # a folder: no bucket, no credentials
        why = "permission denied; " + (
            "make the folder writable by this user (its owner, mode or an immutable flag), or choose another "
            "storage.root"
            if local
            else CREDENTIALS_FIX
        )
    elif any(isinstance(c, socket.gaierror) for c in chain) or "name resolution" in text or "DNS" in text:
        why = f"cannot resolve the storage host (no network, or no DNS); {CREDENTIALS_FIX} once it is reachable"
    elif any(isinstance(c, (ConnectionError, TimeoutError, socket.timeout)) for c in chain) or "Cannot connect" in text:
        why = "cannot connect to the storage host (no network, a firewall, or the endpoint is down)"
    else:
        why = f"{type(exc).__name__}: {str(exc)[:300]}"
    return f"storage.root {url}: {why}"


def filesystem(url: str) -> tuple[Any, str]:
    """`(fs, path)` for `url`, with directory listings never cached. fsspec's default instance of
    a URL's filesystem is shared by the whole process and gcsfs keeps every listing it made in it
    with no expiry, so a long-lived process (the Prefect flow, `grpo serve`, a training worker
    reading its own run root) would go on seeing a folder as it was when first listed: objects
    that worker processes wrote later (an epoch's checkpoints, evaluations, metric shards) stay
    invisible, and a summary names the wrong step. Every reader of a run root, a data source, a
    model folder or a start point goes through here, so a listing or an existence check is true
    when it is made. Local folders and memory:// cache nothing either way."""
    return fsspec.core.url_to_fs(url, use_listings_cache=False)


@functools.cache
def check_reachable(url: str, timeout_s: float = 10.0, field: str | None = None) -> None:
    """For gs://: resolve and connect to the storage endpoint (STORAGE_EMULATOR_HOST's in tests)
    within `timeout_s`, once per process, and raise StorageError saying so if it cannot. gcsfs
    retries a request on connection errors with backoff, and the credential lookup retries the
    metadata server too: without this a root with no network took about a minute per call, six
    minutes a run, before its first error."""
    if not url.startswith("gs://"):
        return
    endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"
    parsed = urllib.parse.urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    host, port = parsed.hostname or "", parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        if field:  # a source the config names, not the run root
            raise StorageError(f"{field} {url}: cannot reach the storage endpoint {host}:{port}: {exc}") from exc
        raise StorageError(f"{describe_storage_error(url, exc)} ({host}:{port}: {exc})") from exc


@contextlib.contextmanager
def _removed_on_error(tmp: str):
    """Delete local file `tmp` when the block fails (a full disk leaves a zero-byte one), then re-raise."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


TEMP_NAME = re.compile(r"\.tmp-[0-9a-f]{8}$")  # write_bytes' and put_file's temporary names


class RunRoot:
    MARKER = "_SUCCESS"

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.path = filesystem(self.url)  # listings uncached: see `filesystem`
        self._local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    @property
    def is_local(self) -> bool:
        """A local folder (atomic renames), not an object store."""
        return self._local

    def uri(self, *parts: str) -> str:
        return posixpath.join(self.url, *parts)

    def _p(self, rel: str) -> str:
        return posixpath.join(self.path, rel)

    # -- objects ---------------------------------------------------------------------------

    def write_bytes(self, rel: str, data: bytes) -> str:
        """Write one whole object. Locally via a temporary name and a rename, so a reader never
        sees half a file; object stores make an upload visible only once complete."""
        path = self._p(rel)
        try:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            if self._local:
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
                with _removed_on_error(tmp):
                    self.fs.pipe_file(tmp, data)
                    self.fs.mv(tmp, path)
            else:
                self.fs.pipe_file(path, data)
        except OSError as exc:
            raise StorageError(f"cannot write {self.uri(rel)}: {describe_storage_error(self.url, exc)}") from exc
        return self.uri(rel)

    def put_file(self, local_path: str, rel: str) -> str:
        """Copy a local file (a large one: it is streamed, not read into memory) to `rel`, whole."""
        path = self._p(rel)
        try:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            if self._local:
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
                with _removed_on_error(tmp):
                    self.fs.put_file(local_path, tmp)
                    self.fs.mv(tmp, path)
            else:
                self.fs.put_file(local_path, path)
        except OSError as exc:
            raise StorageError(f"cannot write {self.uri(rel)}: {exc}") from exc
        return self.uri(rel)

    def get_file(self, rel: str, local_path: str) -> str:
        """Copy `rel` to a local file (streamed, not read into memory)."""
        try:
            self.fs.get_file(self._p(rel), local_path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.uri(rel)} does not exist") from None
        except OSError as exc:
            raise StorageError(f"cannot read {self.uri(rel)}: {describe_storage_error(self.url, exc)}") from exc
        return local_path

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self.fs.cat_file(self._p(rel))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.uri(rel)} does not exist") from None
        except OSError as exc:
            raise StorageError(f"cannot read {self.uri(rel)}: {describe_storage_error(self.url, exc)}") from exc

    def write_json(self, rel: str, obj: Any) -> str:
        """`obj` as strict JSON: NaN and ±Inf become null (see `strict`)."""
        return self.write_bytes(rel, dumps(obj, indent=1, sort_keys=True).encode())

    def read_json(self, rel: str) -> Any:
        """The JSON object at `rel`; DamagedFile naming its URI when it does not parse (cut short)."""
        data = self.read_bytes(rel)
        try:
            return json.loads(data)
        except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
            raise DamagedFile(
                f"{self.uri(rel)} is damaged: not valid JSON ({exc}; {len(data)} bytes), as a write cut short "
                "by a crash or a partial upload leaves it: restore it, or delete it to have it written again"
            ) from None

    def exists(self, rel: str) -> bool:
        try:
            return self.fs.exists(self._p(rel))
        except OSError as exc:
            raise StorageError(f"cannot read {self.uri(rel)}: {describe_storage_error(self.url, exc)}") from exc

    def list(self, rel: str) -> list[str]:
        """Names directly under `rel` (empty if it does not exist)."""
        try:
            return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self._p(rel), detail=False))
        except FileNotFoundError:
            return []

    # -- stages ----------------------------------------------------------------------------

    def mark_done(self, stage_dir: str, info: dict[str, Any] | None = None) -> str:
        """Write the completion marker of `stage_dir`; call it after every output is written."""
        return self.write_json(posixpath.join(stage_dir, self.MARKER), info or {})

    def is_done(self, stage_dir: str) -> bool:
        return self.exists(posixpath.join(stage_dir, self.MARKER))

    def done_info(self, stage_dir: str) -> dict[str, Any]:
        return self.read_json(posixpath.join(stage_dir, self.MARKER))

    def done_for(self, stage_dir: str, train_hash: str) -> dict[str, Any] | None:
        """The marker's info when `stage_dir` is done for this training config, else None."""
        info = self.done_info(stage_dir) if self.is_done(stage_dir) else None
        return info if info is not None and info.get("train_hash") == train_hash else None

    # -- metrics ---------------------------------------------------------------------------

    def write_metrics(self, rows: list[dict[str, Any]]) -> str:
        """One immutable shard `metrics/{first:08d}-{last:08d}.jsonl` of per-step rows."""
        steps = [int(r["step"]) for r in rows]
        if not steps:
            raise ValueError("no metric rows to write")
        body = "".join(dumps(r, sort_keys=True) + "\n" for r in rows).encode()  # strict: NaN -> null
        return self.write_bytes(f"metrics/{min(steps):08d}-{max(steps):08d}.jsonl", body)

    def read_metrics(self) -> list[dict[str, Any]]:
        """All rows, one per step: a step written again (a retried epoch re-running steps past its
        last checkpoint) keeps the row from the newest shard that has it. Every metric is a float,
        so a null (a NaN written as strict JSON) reads back as NaN."""
        by_step: dict[int, dict[str, Any]] = {}
        for name in self.list("metrics"):
            if name.endswith(".jsonl"):
                for row in self._metric_rows(f"metrics/{name}"):
                    by_step[int(row["step"])] = {k: math.nan if v is None else v for k, v in row.items()}
        return [by_step[s] for s in sorted(by_step)]

    def _metric_rows(self, rel: str) -> list[dict[str, Any]]:
        """A shard's complete rows. A line that does not parse (a shard cut short by a crash
        mid-write or a partial upload) is left out with a warning naming the file and the line:
        one damaged shard must not make the whole run unreadable."""
        rows, lines = [], self.read_bytes(rel).decode(errors="replace").splitlines()
        for i, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or "step" not in row:
                    raise ValueError("not a metric row")
            except ValueError as exc:
                _log.warning(
                    "%s: line %d of %d is damaged (%s), left out%s",
                    self.uri(rel),
                    i,
                    len(lines),
                    exc,
                    " (cut short)" if i == len(lines) else "",
                )
                continue
            rows.append(row)
        return rows

    # -- readiness -------------------------------------------------------------------------

    def probe(self) -> None:
        """Write, read back and delete a small object; raise StorageError naming the URL."""
        rel = f".probe-{uuid.uuid4().hex[:8]}"
        payload = uuid.uuid4().bytes
        self.write_bytes(rel, payload)
        try:
            if self.read_bytes(rel) != payload:
                raise StorageError(f"{self.uri(rel)} read back different bytes than were written")
            self.fs.rm_file(self._p(rel))
        except OSError as exc:
            raise StorageError(f"cannot read or delete {self.uri(rel)}: {exc}") from exc


def remove_stale_temp(root: RunRoot, older_than_s: float = 600.0) -> list[str]:
    """Delete the temporary files (`*.tmp-xxxxxxxx`) a killed or failed write left in a local run
    root, those older than `older_than_s` (a `grpo eval` or `export` writing beside the run may
    own a newer one); the paths deleted. Object stores have none: an upload appears whole or not."""
    if not root.is_local or not os.path.isdir(root.path):
        return []
    removed, now = [], time.time()
    for folder, _, files in os.walk(root.path):
        for name in files:
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):  # gone meanwhile: nothing to do
                if TEMP_NAME.search(name) and now - os.path.getmtime(path) > older_than_s:
                    os.remove(path)
                    removed.append(path)
    return removed
