"""Where a model comes from: `model.path` is a Hugging Face Hub id (`Qwen/Qwen3-0.6B`), a local
folder, or a `gs://` (any fsspec URL) folder holding `config.json`, safetensors (one file or a
sharded index), the tokenizer files and, optionally, `generation_config.json`.

`resolve(path)` gives a local folder for each: a local folder as it is; a Hub id through
`huggingface_hub.snapshot_download` (its cache, `HF_HUB_OFFLINE=1` and `HF_TOKEN` work as
usual); a URL copied file by file into `~/.cache/grpo-pipeline/models/` (`GRPO_MODEL_CACHE`
chooses another folder), each file written under a temporary name and renamed, and copied again
only when its size or generation changes. `weights=False` fetches only the small files (config,
tokenizer, generation config): enough for the Prefect process, which prepares data and checks
readiness without the weights.

`HFTokenizer` wraps `transformers.AutoTokenizer` with what the engine needs: one BOS at most
(a chat template that writes its own BOS is not given a second), the stop ids of the model's
generation config, and a pad id (the EOS when the tokenizer has none).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import os
import re
import typing
import uuid
from typing import Any, Sequence

from grpo_core.errors import ConfigError
from grpo_core.store.root import StorageError, filesystem

WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".ckpt")
# Small files a model folder may hold besides its weights, as Hub patterns.
META_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.*",
    "merges.txt",
    "added_tokens.json",
    "chat_template.*",
    "*.tiktoken",
    "preprocessor_config.json",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_url(path: str) -> bool:
    return "://" in path


def looks_local(path: str) -> bool:
    """A path a user meant as a folder on this machine (as opposed to a Hub id)."""
    return path.startswith(("/", "./", "../", "~")) or os.path.isdir(os.path.expanduser(path))


def resolve(path: str, revision: str | None = None, weights: bool = True, field: str = "model.path") -> str:
    """A local folder holding the model at `path` (see the module docstring); errors name `field`."""
    need = MODEL_FILES if field == MODEL_FILES.field else MODEL_FILES._replace(field=field)
    return _resolve(path, revision, weights, need)


def resolve_tokenizer(path: str, revision: str | None = None, field: str = "model.tokenizer") -> str:
    """A local folder holding the tokenizer at `path`: a Hub id, a URL or a folder with the files
    `save_pretrained` writes (tokenizer.json, tokenizer_config.json, ...); no config.json needed,
    as AutoTokenizer needs none. Errors name `field`."""
    return _resolve(path, revision, False, _Need(field, "a tokenizer", TOKENIZER_FILES))


class _Need(typing.NamedTuple):
    field: str  # the config field the folder comes from, named in every error
    what: str  # what the folder must hold, in words
    files: tuple[str, ...]  # at least one of these (fnmatch patterns)

    def found(self, names) -> bool:
        return any(fnmatch.fnmatch(n, p) for n in names for p in self.files)

    def expected(self) -> str:
        if self.files == ("config.json",):
            return "no config.json; expected a Hugging Face model folder"
        return (
            f"none of {', '.join(self.files)}; expected {self.what} as save_pretrained writes it "
            "(tokenizer.json and tokenizer_config.json)"
        )


# The files a tokenizer folder holds (one is enough for AutoTokenizer to find the rest).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "*.tiktoken")
MODEL_FILES = _Need("model.path", "a Hugging Face model folder", ("config.json",))


def _resolve(path: str, revision: str | None, weights: bool, need: _Need) -> str:
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{need.field} must be a Hugging Face id, a folder or a gs:// URL, got {path!r}")
    if is_url(path):
        return _fetch_url(path, weights, need)
    if looks_local(path):
        folder = os.path.abspath(os.path.expanduser(path))
        if not os.path.isdir(folder) or not need.found(os.listdir(folder)):
            what = "does not exist" if not os.path.exists(folder) else f"has {need.expected()}"
            raise ConfigError(f"{need.field} {path!r}: {folder} {what}")
        return folder
    if not _HUB_ID.match(path):
        raise ConfigError(
            f"{need.field} {path!r} is neither an existing folder, a URL nor a Hugging Face id like 'Qwen/Qwen3-0.6B'"
        )
    return _fetch_hub(path, revision, weights, need.field)


def _fetch_hub(repo_id: str, revision: str | None, weights: bool, field: str = "model.path") -> str:
    from huggingface_hub import snapshot_download  # heavy (~0.3 s): only a model from the Hub needs it
    from huggingface_hub.errors import (  # heavy, as above
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    patterns = META_PATTERNS + (["*.safetensors", "*.safetensors.index.json"] if weights else [])
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError) as exc:
        raise ConfigError(
            f"{field} {repo_id!r}{f' revision {revision!r}' if revision else ''}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0]} (no such local folder either)"
        ) from None
    except LocalEntryNotFoundError as exc:  # offline, or the Hub cannot be reached: worth a retry
        raise StorageError(
            f"{field} {repo_id!r} is not in the Hugging Face cache and the Hub cannot be reached "
            f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): {exc}"
        ) from None
    except OSError as exc:
        raise StorageError(f"{field}: cannot download {repo_id!r} from the Hugging Face Hub: {exc}") from None


def cache_dir() -> str:
    base = os.environ.get("GRPO_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "grpo-pipeline", "models"
    )
    return base


def _fetch_url(url: str, weights: bool, need: _Need = MODEL_FILES) -> str:
    """Copy the top-level files of a model (or tokenizer) folder at `url` into the local cache."""
    url = url.rstrip("/")
    local = os.path.join(cache_dir(), hashlib.sha256(url.encode()).hexdigest()[:16])
    try:
        fs, root = filesystem(url)
        entries = [e for e in fs.ls(root, detail=True) if e.get("type") == "file"]
    except FileNotFoundError:
        raise ConfigError(f"{need.field} {url} does not exist") from None
    except OSError as exc:
        raise StorageError(f"cannot list {need.field} {url}: {exc}") from None
    names = {os.path.basename(e["name"].rstrip("/")): e for e in entries}
    if not need.found(names):
        raise ConfigError(f"{need.field} {url} has {need.expected()} (found: {sorted(names)[:10]})")
    wanted = [n for n in names if not n.endswith(OTHER_WEIGHTS) and (weights or not n.endswith(WEIGHT_SUFFIXES))]
    os.makedirs(local, exist_ok=True)
    stamps_path = os.path.join(local, ".sources.json")
    try:
        with open(stamps_path) as f:
            stamps = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        stamps = {}
    for name in sorted(wanted):
        e = names[name]
        stamp = [e.get("size"), e.get("generation") or e.get("md5Hash") or e.get("mtime") or e.get("etag")]
        dest = os.path.join(local, name)
        if stamps.get(name) == json.loads(json.dumps(stamp, default=str)) and os.path.exists(dest):
            continue
        tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            fs.get_file(e["name"], tmp)
            os.replace(tmp, dest)
        except OSError as exc:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise StorageError(f"cannot copy {url}/{name} to {dest}: {exc}") from None
        stamps[name] = json.loads(json.dumps(stamp, default=str))
        tmp = f"{stamps_path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            json.dump(stamps, f)
        os.replace(tmp, stamps_path)
    return local


@functools.lru_cache(maxsize=16)
def read_config(path: str, revision: str | None = None, field: str = "model.path") -> dict[str, Any]:
    """The model's config.json (fetching only the small files of a remote model); errors name `field`."""
    folder = resolve(path, revision, weights=False, field=field)
    where = os.path.join(folder, "config.json")
    try:
        with open(where) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{field} {path!r}: config.json is not valid JSON: {exc}") from None


def model_config(cfg, vocab_size: int | None = None):
    """The run's architecture (grpo_core.config.model.ModelConfig): with model.path, from the
    checkpoint's config.json (fetched as read_config does); else the preset's."""
    checkpoint = read_config(cfg.model_path, cfg.model.revision) if cfg.model_path else None
    return cfg.model_config(vocab_size, checkpoint)


def generation_config(folder: str) -> dict[str, Any]:
    where = os.path.join(folder, "generation_config.json")
    if not os.path.exists(where):
        return {}
    try:
        with open(where) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not valid JSON: {exc}") from None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


class HFTokenizer:
    """A Hugging Face tokenizer with the interface the engine uses (encode, decode, eos/pad ids,
    stop ids, vocab size, chat template)."""

    def __init__(self, folder: str, field: str = "model.tokenizer"):
        from transformers import AutoTokenizer  # heavy (~2 s): only an HF tokenizer needs it

        try:
            self.tok = AutoTokenizer.from_pretrained(folder)
        except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, its own types
            raise ConfigError(f"{field}: cannot load a tokenizer from {folder}: {type(exc).__name__}: {exc}") from None
        self.folder = folder
        gen = generation_config(folder)
        stops = _ids(gen.get("eos_token_id")) + _ids(self.tok.eos_token_id)
        self.stop_ids = list(dict.fromkeys(stops))
        if not self.stop_ids:
            raise ConfigError(
                f"{field}: the tokenizer in {folder} has no EOS token and generation_config.json names none: "
                "completions could never end"
            )
        self.eos_token_id = self.stop_ids[0]
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else gen.get("pad_token_id")
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_id
        self.vocab_size = len(self.tok)
        # Whether the tokenizer puts BOS in front of plain text (Llama does, Qwen does not).
        bos = self.tok.bos_token_id
        probe = self.tok("a")["input_ids"] if bos is not None else []
        self.bos_id = bos if probe and probe[0] == bos else None

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]  # exactly one BOS, also when a chat template wrote it
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages, **kwargs):
        return self.tok.apply_chat_template(messages, **kwargs)

    def save_pretrained(self, folder: str) -> None:
        """Tokenizer files (and the chat template) into an exported model folder."""
        self.tok.save_pretrained(folder)


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str, revision: str | None = None, field: str = "model.tokenizer") -> HFTokenizer:
    """The tokenizer at `path` (a Hub id, a URL or a folder, with or without a model beside it);
    errors name `field`."""
    return HFTokenizer(resolve_tokenizer(path, revision, field), field)
