"""A run's folder: created with its validated config, and refused to a config that would train
something else in it."""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_core.config.run import RunConfig, _merge, read_config
from grpo_core.errors import ConfigError
from grpo_core.store.report import latest_checkpoint
from grpo_core.store.root import RunRoot, check_reachable


def init_run_root(cfg: RunConfig) -> RunRoot:
    """Write the validated config (and its stage hashes) to {run}/config.json. A run folder that
    already holds a config with another training hash is refused: its checkpoints are not ours."""
    check_reachable(cfg.run_url)  # seconds, not minutes of gcsfs retries, when there is no network
    root = RunRoot(cfg.run_url)
    if check_run_root(cfg, root):
        return root
    hashes = {"data": cfg.data_hash, "train": cfg.train_hash, "eval": cfg.eval_hash}
    root.write_json("config.json", dict(cfg.to_dict(), hashes=hashes))
    return root


def check_run_root(cfg: RunConfig, root: RunRoot | None = None) -> bool:
    """ConfigError where the run folder holds a config that trains something else (naming what
    differs: a field, or an input whose content changed, an edited reward file among them), once
    that run trained anything (a run that failed before its first step gives its name to the new
    config: nothing of it is lost); reads only, so the flow refuses such a run before any task and
    `grpo check` reports it. True where the folder's config.json is to be kept as it is (a run
    started before its inputs were versioned)."""
    root = root or RunRoot(cfg.run_url)
    if root.exists("config.json"):
        old = RunConfig.from_dict(root.read_json("config.json"))
        unversioned = dataclasses.replace(cfg, versions=())
        if not old.versions and cfg.versions and old.train_hash == unversioned.train_hash:
            return True  # started before its inputs were versioned: it keeps its config.json and hashes
        code = cfg.code_versions("rewards[", "eval.rewards[")
        if code and not old.code_versions("rewards[", "eval.rewards["):
            before = dataclasses.replace(cfg, versions=tuple(kv for kv in cfg.versions if kv[0] not in code))
            if old.train_hash == before.train_hash:
                return True  # started before code was versioned by its content: it keeps its config.json
        if old.train_hash != cfg.train_hash and not trained_anything(root):
            # failed before its first step (its data, its readiness, a reward that did not load):
            # nothing of it would be lost, so the corrected config takes the name over
            return False
        if old.train_hash != cfg.train_hash:
            diff = _diff(old.to_dict(), cfg.to_dict())
            changed = [d.removeprefix("versions.") for d in diff if d.startswith("versions.")]
            # train.num_steps: auto, counted from the data (recorded beside the versions): it follows them
            counted = any(c.startswith("train.num_steps:") for c in changed)
            follows = [d for d in diff if counted and d.startswith("train.num_steps:")]
            if changed and len(changed) + len(follows) == len(diff):  # same config, new content
                edited = [c for c in changed if c.startswith(("rewards[", "eval.rewards["))]
                files = [dict(cfg.code).get(c.split(":", 1)[0], "") for c in edited]
                raise ConfigError(
                    f"run {cfg.name!r} at {cfg.run_url} was started on other inputs: "
                    f"{'; '.join(changed)} (the source changed since"
                    + (f"; edited code: {', '.join(f.rsplit(':', 1)[0] for f in files)}" if files else "")
                    + "); set run_name to a new name (e.g. with the date), or run_name: null to name runs by their "
                    "config and inputs"
                )
            raise ConfigError(
                f"run {cfg.name!r} at {cfg.run_url} was started with another config "
                f"(different: {', '.join(diff[:8])}); set run_name to a new name, or run_name: null "
                "to name runs by their config"
            )
    return False


def trained_anything(root: RunRoot) -> bool:
    """Whether a run folder holds anything training made: a checkpoint or a metrics row."""
    return latest_checkpoint(root) is not None or bool(root.list("metrics"))


# What `--set` may name for a command on an existing run: where the run is, nothing of it.
LOCATING = ("storage", "run_name")


def check_overrides(root: RunRoot, overrides: list[str], command: str) -> None:
    """ConfigError unless the `--set` overrides leave the run's config.json as it is (those that
    locate the run aside). `grpo eval` and `grpo export` act on the run as its config.json says:
    its evaluation rows are part of its prepared data (the data hash, and so the training hash),
    eval/{step}.json holds the result for its eval hash; --set data.eval_rows=16 was silently
    ignored and the stored result read back (issue 53). Refused, naming what would change."""
    stored = root.read_json("config.json")
    old = RunConfig.from_dict(stored)
    given = {k: v for k, v in read_config(None, overrides).items() if k not in LOCATING}
    new = RunConfig.from_dict(_merge(stored, given))
    changed = [d for d in _diff(old.to_dict(), new.to_dict()) if d.split(".", 1)[0].split(":")[0] not in LOCATING]
    if changed:
        raise ConfigError(
            f"{command} works on the run as its config.json says ({root.url}/config.json), and --set would change "
            f"it: {'; '.join(changed[:8])}. Its evaluation rows are part of its prepared data and each "
            "eval/{step}.json is the result for its own eval settings, so other settings are another run: start one "
            "with them (grpo run --set ...). Here --set may only say where the run is (storage.root, run_name)"
        )


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{path}.{k}".lstrip("."))]
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"]
