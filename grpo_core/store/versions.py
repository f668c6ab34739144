"""What a run's inputs are, not only where they are: a cheap version of each source a config
names, so a file rewritten in place, a gs:// object uploaded again, a model folder rebuilt or a
Hub repository that moved on is a new input, not yesterday's.

- a local file: its size and modification time (ns); a local folder: a digest of its files'
  names, sizes and modification times (a stat each, nothing read)
- a gs:// (or other fsspec) object: its generation (GCS), else its ETag, else size and mtime; a
  folder: a digest of its objects' names and those versions
- a Hugging Face Hub id: the commit its revision resolves to (a 40-hex revision is already one);
  where it cannot be resolved (offline, HF_HUB_OFFLINE), `unresolved@<revision>` and a warning:
  an upload to that repository will not be noticed until a revision is pinned

- a reward model (rewards[i].model): as model.path, so a rebuilt classifier folder is a new run
- code a config names (a reward's `file.py:fn`, a module's file): a digest of the file's content,
  so an edited reward is a new run (or, under a fixed run_name, a refusal naming the file), never
  yesterday's run reported again; a built-in is the project's own code, a pickled callable
  (grpo_core.rewards.by_value) is already named by the digest of its source

grpo_core.resolve computes them once per invocation, before the run is named, beside the start
point model.init_from resolves to (grpo_core.store.startpoint.pin): they are part of the data and
training hashes, recorded in config.json and the data manifest.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from typing import Any, Callable

from grpo_core.config.run import PICKLED
from grpo_core.store.root import check_reachable, filesystem
from grpo_core.store.sources import is_url, looks_local

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def _digest(entries: list[tuple[Any, ...]]) -> str:
    h = hashlib.sha256()
    for e in sorted(entries):
        h.update(repr(e).encode())
    return "files:" + h.hexdigest()[:16]


def _local(path: str) -> str:
    path = os.path.expanduser(path)
    st = os.stat(path)
    if not os.path.isdir(path):
        return f"size:{st.st_size},mtime_ns:{st.st_mtime_ns}"
    entries = []
    for folder, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # caches (.cache, .git) are not the data
        for name in files:
            full = os.path.join(folder, name)
            s = os.stat(full)
            entries.append((os.path.relpath(full, path), s.st_size, s.st_mtime_ns))
    return _digest(entries)


def _object_version(info: dict[str, Any]) -> str:
    for key in ("generation", "ETag", "etag", "md5Hash"):
        if info.get(key):
            return f"{key.lower()}:{str(info[key]).strip(chr(34))}"
    return f"size:{info.get('size')},mtime:{info.get('mtime') or info.get('updated') or info.get('LastModified')}"


def _remote(url: str) -> str:
    fs, path = filesystem(url)
    info = fs.info(path)
    if info.get("type") != "directory":
        return _object_version(info)
    found = fs.find(path, detail=True)
    return _digest([(k[len(path) :], _object_version(v)) for k, v in found.items()])


def _hub(repo_id: str, revision: str | None, kind: str) -> str:
    if revision and _COMMIT.match(revision):
        return f"commit:{revision}"
    try:
        if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
            raise OSError("HF_HUB_OFFLINE is set")
        from huggingface_hub import HfApi  # heavy (~0.3 s): only a Hub id needs it

        api = HfApi()
        info = (api.dataset_info if kind == "dataset" else api.model_info)(repo_id, revision=revision, timeout=10)
        return f"commit:{info.sha}"
    except Exception:  # noqa: BLE001 - offline, private or unknown: recorded as such and warned about
        return f"unresolved@{revision or 'main'}"


def version_of(source: str, revision: str | None = None, kind: str = "model") -> str | None:
    """A version of `source` (a local path, an fsspec URL or a Hub id), or None where it names
    nothing that exists yet (the stage that reads it reports that, with its own message)."""
    try:
        if is_url(source):
            return _remote(source)
        if looks_local(source) or os.path.exists(os.path.expanduser(source)):
            return _local(source)
    except FileNotFoundError:
        return None
    return _hub(source, revision, kind)


def code_file(spec: str) -> str | None:
    """The file of the code `spec` names (`path/file.py:fn`, or `module:fn` through the module's
    spec; finding a submodule's imports its packages, as loading it will), or None: a built-in,
    a pickled callable, or code that cannot be found (the stage that loads it names that)."""
    where = spec.rsplit(":", 1)[0] if ":" in spec else ""
    if not where or where.endswith(PICKLED):
        return None
    if where.endswith(".py"):
        return os.path.expanduser(where)
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError):
        return None
    return found.origin if found is not None and found.has_location else None


def content_version(path: str) -> str | None:
    """A digest of a file's content (None where it cannot be read: loading it reports that)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return None
    return "sha256:" + h.hexdigest()[:16]


def code_versions(cfg) -> dict[str, str]:
    """The content version of each file of code `cfg` (a RunConfig) names, by the field naming it."""
    out = {}
    for field, spec in cfg.code:
        path = code_file(spec)
        version = content_version(path) if path else None
        if version is not None:
            out[field] = version
    return out


def source_versions(cfg, warn: Callable[[str], None] | None = None) -> dict[str, str]:
    """The versions of the sources `cfg` (a RunConfig) names, by the field that names them."""
    named: dict[str, tuple[str, str | None, str]] = {}
    if cfg.data.source != "synthetic":
        named["data.source"] = (cfg.data.source, None, "dataset")
    if cfg.data.eval_source:
        named["data.eval_source"] = (cfg.data.eval_source, None, "dataset")
    if cfg.model.path:
        named["model.path"] = (cfg.model.path, cfg.model.revision, "model")
    if cfg.model.tokenizer not in ("char", "auto"):
        named["model.tokenizer"] = (cfg.model.tokenizer, None, "model")
    for field, spec in cfg.reward_models:  # a rebuilt reward model folder is a new run, as model.path is
        named[field] = (spec.model, None, "model")
    out = code_versions(cfg)
    for field, (source, revision, kind) in named.items():
        check_reachable(source, field=field)  # seconds, not minutes of gcsfs retries, without network
        v = version_of(source, revision, kind)
        if v is None:
            continue
        if v.startswith("unresolved@") and warn is not None:
            warn(
                f"{field} {source!r}: its revision could not be resolved (no network or HF_HUB_OFFLINE), so a new "
                "upload to it is not noticed; pin a commit (model.revision) to train on a known version"
            )
        out[field] = v
    return out
