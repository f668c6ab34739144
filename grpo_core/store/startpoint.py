"""Where a continual run starts: `model.init_from` resolved to one policy of another run.

    init_from: nightly-2026-11-23          # a run under storage.root: its newest policy
    init_from: nightly-2026-11-23@400      # that run's policy after 400 steps
    init_from: gs://bucket/runs/base-run   # a run's folder anywhere (or a local folder)
    init_from: nightly-*                   # the last finished run whose name matches
                                           # (none yet, the first night: the base model)

A run's policies are its finalised checkpoints and its complete Hugging Face exports; the
newest is the highest step, the export where both exist (a plain model folder to load). A
pattern takes, among the runs under storage.root whose names match (this run's own excepted),
the greatest name whose training finished (a policy at its train.num_steps): names that carry
the date, as run_name templates write them, sort in time.

The resolved point (pin, which grpo_core.resolve calls beside the sources' versions of
grpo_core.store.versions) is a version like theirs: recorded in
config.json as versions["model.init_from"] = "<run url>@<step>:<checkpoint|export>:<train hash>",
part of the training hash, read back by the worker that builds the starting policy. JAX-free.

A run keeps its own copy of that policy: its first training writes it to `start/` (a plain
Hugging Face folder, LoRA merged; the marker last records the version). Evaluation, resumes and
re-runs read the copy, so the run outlives the deletion of the run it started from: a re-run
whose source is gone takes the version a run of the same config pinned and copied.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import posixpath
import re
from typing import Any, Callable

from grpo_core.config.run import KINDS, NO_MATCH, RunConfig, StartPoint, is_template  # noqa: F401 - KINDS, StartPoint: re-exported
from grpo_core.errors import ConfigError
from grpo_core.store.report import checkpoint_steps, export_steps
from grpo_core.store.root import RunRoot
from grpo_core.store.sources import model_config

_STEP = re.compile(r"^(?P<run>.+?)@(?P<step>\d+)$")
COPY = "start"  # a run's own copy of the policy it started from: start/{config.json, model.safetensors}


class StartSourceMissingError(ConfigError):
    """model.init_from names a run (or folder) that is not there (any more)."""


def _is_name(ref: str) -> bool:
    return "://" not in ref and "/" not in ref.strip("/") and not ref.startswith((".", "~"))


def _run_url(cfg, ref: str) -> str:
    if _is_name(ref):
        return f"{cfg.storage_url}/{ref.strip('/')}"
    return ref.rstrip("/") if "://" in ref else os.path.abspath(os.path.expanduser(ref))


def policies(root: RunRoot) -> dict[int, str]:
    """step -> "export" or "checkpoint": every policy the run holds (an export where both)."""
    out = {s: "checkpoint" for s in checkpoint_steps(root)}
    out.update({s: "export" for s in export_steps(root)})
    return out


def _source_config(run_url: str, field: str):
    root = RunRoot(run_url)
    if not root.exists("config.json"):
        raise StartSourceMissingError(f"{field}: {run_url} is not a run (no config.json there)")
    return RunConfig.from_dict(root.read_json("config.json"))


def _finished(run_url: str) -> bool:
    try:
        cfg = _source_config(run_url, "model.init_from")
    except (ConfigError, ValueError):
        return False
    return cfg.train.num_steps in policies(RunRoot(run_url))


def _match(cfg, pattern: str) -> tuple[str | None, list[str]]:
    """The run under storage.root that `pattern` picks (the greatest matching name that
    finished), or None, and the matching names."""
    top = RunRoot(cfg.storage_url)
    own = cfg.run_name.strip("/") if cfg.run_name and not is_template(cfg.run_name) else None
    names = sorted(
        (n for n in top.list("") if fnmatch.fnmatchcase(n, pattern) and n != own and not n.startswith(("_", "."))),
        reverse=True,
    )
    for name in names:
        url = _run_url(cfg, name)
        if _finished(url):
            return url, names
    return None, names


def resolve(cfg, warn: Callable[[str], None] | None = None) -> StartPoint | None:
    """The policy `cfg.model.init_from` names, checked against `cfg` (same architecture and
    tokenizer), or ConfigError naming the field and what is wrong. A pattern that matches no
    finished run yet (the first night of a nightly chain) is None: the run starts from the base
    model, and `warn` says so."""
    ref = cfg.model.init_from.strip()
    m = _STEP.match(ref)
    ref, step = (m["run"], int(m["step"])) if m else (ref, None)
    if _is_name(ref) and any(c in ref for c in "*?["):
        if step is not None:
            raise ConfigError(
                f"model.init_from {cfg.model.init_from!r}: a pattern takes each run's last step, not @{step}"
            )
        url, names = _match(cfg, ref)
        if url is None:
            if warn is not None:
                warn(
                    f"model.init_from {ref!r}: no finished run under {cfg.storage_url} matches it"
                    + (f" (matching, not finished: {', '.join(names[:5])})" if names else "")
                    + "; this run starts from the base model (model.path or the preset)"
                )
            return None
    else:
        url = _run_url(cfg, ref)
    if cfg.run_name and not is_template(cfg.run_name) and url.rstrip("/") == cfg.run_url.rstrip("/"):
        raise ConfigError(f"model.init_from {cfg.model.init_from!r} is this run itself ({cfg.run_url})")
    source = _source_config(url, f"model.init_from {cfg.model.init_from!r}")
    found = policies(RunRoot(url))
    if step is None:
        if not found:
            raise ConfigError(
                f"model.init_from {cfg.model.init_from!r}: the run at {url} has no finalised checkpoint or export yet"
            )
        step = max(found)
    elif step not in found:  # gone (a checkpoint rotated out, an export deleted) or never there
        raise StartSourceMissingError(
            f"model.init_from {cfg.model.init_from!r}: the run at {url} has no checkpoint or export of step {step}; "
            f"it has steps {sorted(found) or 'none'}"
        )
    _check_compatible(cfg, source, url)
    return StartPoint(url, step, found[step], source.train_hash)


def pin(cfg, versions: dict[str, str], warn: Callable[[str], None] | None = None) -> str | None:
    """The version model.init_from is pinned to for this run (StartPoint.version, or NO_MATCH for
    a pattern no finished run matches yet); None without init_from. `versions`: the sources'
    (grpo_core.store.versions), which say whether a run of this very config holds a copy to go on
    from where the source run is gone (pinned_copy)."""
    if cfg.model.init_from is None:
        return None
    try:
        start = resolve(cfg, warn)
    except StartSourceMissingError as gone:  # a run of this config that copied it goes on from its copy
        pinned = pinned_copy(cfg, versions)
        if pinned is None:
            raise StartSourceMissingError(
                f"{gone}; no run of this config under {cfg.storage_url} holds a copy of a policy it started "
                "from (a run copies its start to start/ at its first training step)"
            ) from None
        if warn is not None:
            warn(f"{gone}: this run goes on from its own copy of the policy it started from ({pinned})")
        return pinned
    return start.version if start is not None else f"{NO_MATCH} {cfg.model.init_from!r}"


def _check_compatible(cfg, source, url: str) -> None:
    """The source run's policy must fit this config's model: same architecture, same tokenizer."""
    field = f"model.init_from {cfg.model.init_from!r}"
    if source.tokenizer_id != cfg.tokenizer_id:
        raise ConfigError(
            f"{field}: the run at {url} used tokenizer {source.tokenizer_id}, this config {cfg.tokenizer_id}; "
            "a policy is read with the tokenizer it was trained with"
        )
    mine, theirs = model_config(cfg), model_config(source)
    differ = [
        f"{f.name} {getattr(theirs, f.name)!r} there, {getattr(mine, f.name)!r} here"
        for f in dataclasses.fields(mine)
        if getattr(mine, f.name) != getattr(theirs, f.name)
    ]
    if differ:
        raise ConfigError(
            f"{field}: the run at {url} trained another model ({'; '.join(differ)}); set model as that run "
            f"did (its config.json: {posixpath.join(url, 'config.json')})"
        )


def copy_of(root: RunRoot, start: StartPoint) -> str | None:
    """The URI of the run's own complete copy of `start` (its marker names that very version), else None."""
    if not root.is_done(COPY):
        return None
    return root.uri(COPY) if root.done_info(COPY).get("version") == start.version else None


def source_gone(start: StartPoint) -> bool:
    """Whether the policy `start` names is no longer where it was pinned."""
    source = RunRoot(start.run_url)
    if start.kind == "export":
        return not source.is_done(f"export/{start.step}")
    return not (source.exists("config.json") and start.step in checkpoint_steps(source))


def pinned_copy(cfg, versions: dict[str, str]) -> str | None:
    """With the run model.init_from names gone: the start version a run of this very config (the
    run_name's run, else a run under storage.root named by its hash whose config.json matches this
    one in every field but the start) pinned and holds a copy of; None where there is none."""

    def comparable(c) -> dict[str, Any]:
        d = c.to_dict()
        d["versions"] = {k: v for k, v in (d.get("versions") or {}).items() if k != "model.init_from"}
        if cfg.train.num_steps == "auto":  # resolved from the data's rows after the versions
            d["train"].pop("num_steps", None)
        return d

    mine = comparable(dataclasses.replace(cfg, versions=tuple(sorted(versions.items()))))
    if cfg.run_name and not is_template(cfg.run_name):
        urls = [cfg.run_url]
    else:
        top = RunRoot(cfg.storage_url)
        urls = [_run_url(cfg, n) for n in top.list("") if not n.startswith(("_", "."))]
    for url in urls:
        root = RunRoot(url)
        try:
            if not (root.is_done(COPY) and root.exists("config.json")):
                continue
            other = RunConfig.from_dict(root.read_json("config.json"))
            version = dict(other.versions).get("model.init_from")
        except (ConfigError, ValueError, OSError):
            continue  # not a run of this project's, or damaged: not this config's
        if version and root.done_info(COPY).get("version") == version and comparable(other) == mine:
            return version
    return None
