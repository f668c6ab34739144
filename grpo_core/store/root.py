"""A run root addressed by URL: a local folder (default), `gs://bucket/prefix` (gcsfs), or
`memory://` for tests. One run = one folder; see the run-root layout in DESIGN.md.

Rules that make stages safe to retry: every object is written whole (GCS objects are
immutable: metrics go to new shards, never appends); a stage writes its outputs first and its
completion marker last, so a marker means the outputs are complete; a stage's outputs live
under a short hash of the config fields that matter to it.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import uuid
from typing import Any

import fsspec

from grpo_core.errors import StorageError


def config_hash(fields: dict[str, Any], length: int = 12) -> str:
    """Short stable hash of a config (key order does not matter)."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:length]


class RunRoot:
    MARKER = "_SUCCESS"

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.path = fsspec.core.url_to_fs(self.url)
        self._local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

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
                self.fs.pipe_file(tmp, data)
                self.fs.mv(tmp, path)
            else:
                self.fs.pipe_file(path, data)
        except OSError as exc:
            raise StorageError(f"cannot write {self.uri(rel)}: {exc}") from exc
        return self.uri(rel)

    def put_file(self, local_path: str, rel: str) -> str:
        """Copy a local file (a large one: it is streamed, not read into memory) to `rel`, whole."""
        path = self._p(rel)
        try:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            if self._local:
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
                self.fs.put_file(local_path, tmp)
                self.fs.mv(tmp, path)
            else:
                self.fs.put_file(local_path, path)
        except OSError as exc:
            raise StorageError(f"cannot write {self.uri(rel)}: {exc}") from exc
        return self.uri(rel)

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self.fs.cat_file(self._p(rel))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.uri(rel)} does not exist") from None

    def write_json(self, rel: str, obj: Any) -> str:
        return self.write_bytes(rel, json.dumps(obj, indent=1, sort_keys=True).encode())

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self._p(rel))

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

    # -- metrics ---------------------------------------------------------------------------

    def write_metrics(self, rows: list[dict[str, Any]]) -> str:
        """One immutable shard `metrics/{first:08d}-{last:08d}.jsonl` of per-step rows."""
        steps = [int(r["step"]) for r in rows]
        if not steps:
            raise ValueError("no metric rows to write")
        body = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()
        return self.write_bytes(f"metrics/{min(steps):08d}-{max(steps):08d}.jsonl", body)

    def read_metrics(self) -> list[dict[str, Any]]:
        """All rows, one per step: a step written again (a retried epoch re-running steps past its
        last checkpoint) keeps the row from the newest shard that has it."""
        by_step: dict[int, dict[str, Any]] = {}
        for name in self.list("metrics"):
            if name.endswith(".jsonl"):
                for line in self.read_bytes(f"metrics/{name}").decode().splitlines():
                    row = json.loads(line)
                    by_step[int(row["step"])] = row
        return [by_step[s] for s in sorted(by_step)]

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
