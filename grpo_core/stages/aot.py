"""The compiler's half of the readiness stage, run in its own process from any host:

    python -m grpo_core.stages.aot --request req.json     # prints one JSON report

AOT-compiles every program of the run for a TPU topology that need not be here
(grpo_core.rl.aot) and reports XLA's figures per chip against the chip's HBM. Exit 0 when
every program fits, 4 when one does not (the report names it, XLA's figure and the setting that
would fit), 2 when the request is invalid or libtpu is missing (the message says what to install).

The request carries the model and train configs, `max_prompt_tokens`, `target` (`v5e:2x2`) and
optionally `num_slices`, `eval` ({batch_size, num_samples, temperature}), `lora` (the model.lora
section), `separate_reference` and `programs` (the names to compile; default all). Reports are
cached on disk by (the request, a digest of grpo_core's source, the jax / jaxlib / libtpu / flax /
optax versions): a second
check of the same programs reads the report back in well under a second, before JAX is
imported. Each program's figures are cached too (under programs/, by its lowered module): a
config that changes only evaluation compiles only evaluation. The folder is GRPO_AOT_CACHE_DIR,
else ~/.cache/grpo-pipeline/aot (XDG_CACHE_HOME); GRPO_AOT_CACHE=0 turns both off.
GRPO_AOT_THREADS: programs other than the update compiled at once, beside the update's candidates
(default 2, at most the host's cores).

This process never opens a TPU, not even on a TPU VM whose chips a training worker holds: it
runs JAX on the CPU and loads libtpu's compiler without its lockfile (ALLOW_MULTIPLE_LIBTPU_LOAD).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from importlib import metadata
from typing import Any

from grpo_core.config.model import LoraConfig, ModelConfig
from grpo_core.config.target import Target
from grpo_core.config.train import TrainConfig
from grpo_core.errors import ConfigError, ExitCode
from grpo_core.store.sources import model_config

# JAX-free: the Prefect side imports this module (tasks/readiness.py: request_for); grpo_core.rl.aot,
# which imports JAX, is imported inside the functions that use it (to compile: after _compiler_env).

_VERSIONED = ("jax", "jaxlib", "libtpu", "flax", "optax")


def versions() -> dict[str, str | None]:
    """The versions the compiled programs depend on (libtpu None: not installed)."""
    out: dict[str, str | None] = {}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def request_for(cfg, vocab_size: int) -> dict[str, Any]:
    """The request for a run config's programs (grpo_core.config.run.RunConfig), for
    pipeline.readiness.target; `vocab_size`: the tokenizer's."""
    train = cfg.train.replace(num_steps=1).to_dict()
    # the synchronous colocated run's request as it was before these fields existed: its key holds
    if train["max_staleness"] == 0:
        del train["max_staleness"]
    for name, default in (("layout", "colocated"), ("devices", None)):
        if train["rollout"][name] == default:
            del train["rollout"][name]
    return {
        "model": model_config(cfg, vocab_size=vocab_size).to_dict(),
        # num_steps (maybe still auto before the data is prepared) only sets the learning-rate
        # schedule's length: no program's shape or memory, so neither the key nor the compile sees it
        "train": train,
        "max_prompt_tokens": cfg.data.max_prompt_tokens,
        "target": cfg.pipeline.readiness.target,
        "num_slices": cfg.pipeline.readiness.num_slices,
        "eval": {k: getattr(cfg.eval, k) for k in ("batch_size", "num_samples", "temperature")},
        "lora": cfg.model.to_dict().get("lora"),
        "separate_reference": cfg.separate_reference,
    }


def programs_key(req: dict[str, Any]) -> str:
    """The programs' identity: the request's configs and target (not the compiler's versions)."""
    keys = ("model", "train", "max_prompt_tokens", "eval", "lora", "separate_reference", "programs")
    body = {k: req.get(k) for k in keys} | {"target": req["target"], "num_slices": req.get("num_slices", 1)}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:24]


# bumped when what a report holds or how it counts changes: older reports are not read (4: the estimate)
REPORT_FORMAT = 4

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # grpo_core/


def code_digest() -> str:
    """A digest of grpo_core's source: the code that builds the programs. A report is read back only
    by the code that wrote it (a change to the model, the loss or the chunking changes what XLA
    compiles, though the config is the same); the per-program cache, keyed by the lowered module,
    still spares the compiles of programs the change left alone."""
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(_PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, _PACKAGE).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def cache_key(req: dict[str, Any]) -> str:
    """The programs' identity, the code that builds them, the compiler's versions and the report's format."""
    body = {"programs": programs_key(req), "code": code_digest(), "format": REPORT_FORMAT, **versions()}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24]


def cache_dir() -> str | None:
    if os.environ.get("GRPO_AOT_CACHE", "1") == "0":
        return None
    if os.environ.get("GRPO_AOT_CACHE_DIR"):
        return os.environ["GRPO_AOT_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "grpo-pipeline", "aot")


def _read_cache(key: str) -> dict[str, Any] | None:
    folder = cache_dir()
    if folder is None:
        return None
    try:
        with open(os.path.join(folder, f"{key}.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _write_cache(key: str, report: dict[str, Any]) -> None:
    folder = cache_dir()
    if folder is None:
        return
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as f:  # whole or absent
        json.dump(report, f)
    os.replace(f.name, os.path.join(folder, f"{key}.json"))


def program_cache(**identity: Any):
    """grpo_core.rl.aot.ProgramCache under the cache folder's programs/, its keys salted with
    `identity` (the target, or the local backend and its devices), the compiler's versions and
    the report's format."""
    from grpo_core.rl.aot import ProgramCache  # JAX: the Prefect side imports this module

    folder = cache_dir()
    salt = json.dumps({"format": REPORT_FORMAT, **identity, **versions()}, sort_keys=True, default=str)
    return ProgramCache(None if folder is None else os.path.join(folder, "programs"), salt)


def _compiler_env() -> None:
    """Before JAX is imported: the CPU backend only, and libtpu as a compiler, never as a device
    owner (no /tmp/libtpu_lockfile, no metadata-server query)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def parse_request(req: Any):
    """(model, train, max_prompt_tokens, target, eval shape, lora, separate_reference), or ConfigError."""
    if not isinstance(req, dict):
        raise ConfigError(f"the AOT request must be a JSON object, got {type(req).__name__}")
    for key in ("model", "train", "max_prompt_tokens", "target"):
        if key not in req:
            raise ConfigError(f"AOT request lacks {key!r}")
    mpt = req["max_prompt_tokens"]
    if not (isinstance(mpt, int) and not isinstance(mpt, bool) and mpt > 0):
        raise ConfigError(f"request.max_prompt_tokens must be a positive integer, got {mpt!r}")
    ev = req.get("eval") or {}
    evaluation = (
        int(ev.get("batch_size", 64)),
        int(ev.get("num_samples", 4)),
        float(ev.get("temperature", 1.0)),
    )
    return (
        ModelConfig.from_dict(req["model"]),
        TrainConfig.from_dict(req["train"]),
        mpt,
        Target.parse(req["target"], req.get("num_slices", 1)),
        evaluation,
        LoraConfig.from_value(req["lora"]) if req.get("lora") else None,
        bool(req.get("separate_reference")),
    )


def run(req: dict[str, Any]) -> dict[str, Any]:
    """The report for `req`, from the cache or from the compiler."""
    t = time.perf_counter()
    model, train, mpt, target, ev, lora, separate = parse_request(req)  # before the cache: refuse bad input
    key = cache_key(req)
    cached = _read_cache(key)
    if cached is not None:
        return dict(cached, cached=True, seconds=round(time.perf_counter() - t, 3))
    if versions()["libtpu"] is None:
        from grpo_core.rl.aot import INSTALL  # JAX: the Prefect side imports this module

        raise ConfigError(f"checking a TPU target needs XLA's TPU compiler (libtpu), not installed here: {INSTALL}")
    _compiler_env()
    from grpo_core.rl import aot  # JAX: after _compiler_env sets JAX_PLATFORMS

    only = None if req.get("programs") is None else tuple(p for p in req["programs"] if p != "update")
    programs = program_cache(target=target.to_dict())
    threads = int(os.environ.get("GRPO_AOT_THREADS") or min(2, os.cpu_count() or 1))
    report = aot.check(
        model, train, mpt, target, aot.EvalShape(*ev), lora, separate, only=only, cache=programs, threads=threads
    )
    report.update(versions=versions(), cache_key=key, programs_key=programs_key(req))
    _write_cache(key, report)
    return dict(report, cached=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grpo_core.stages.aot", description=__doc__.split("\n")[0])
    ap.add_argument("--request", required=True, help="JSON request file")
    args = ap.parse_args(argv)
    try:
        with open(args.request) as f:
            req = json.load(f)
        report = run(req)
        code = ExitCode.OK if report["memory"]["fits"] else ExitCode.NOT_READY
    except (OSError, json.JSONDecodeError, ConfigError, TypeError, ValueError) as exc:
        report, code = {"error": f"{type(exc).__name__}: {exc}"}, ExitCode.CONFIG
    print(json.dumps(report), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
