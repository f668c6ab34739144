"""A run's folder: created with its validated config, and refused to a config that would train
something else in it."""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_core.config.run import RunConfig
from grpo_core.errors import ConfigError
from grpo_core.store.root import RunRoot, check_reachable


def init_run_root(cfg: RunConfig) -> RunRoot:
    """Write the validated config (and its stage hashes) to {run}/config.json. A run folder that
    already holds a config with another training hash is refused: its checkpoints are not ours."""
    check_reachable(cfg.run_url)  # seconds, not minutes of gcsfs retries, when there is no network
    root = RunRoot(cfg.run_url)
    if root.exists("config.json"):
        old = RunConfig.from_dict(root.read_json("config.json"))
        unversioned = dataclasses.replace(cfg, versions=())
        if not old.versions and cfg.versions and old.train_hash == unversioned.train_hash:
            return root  # started before its inputs were versioned: it keeps its config.json and hashes
        if old.train_hash != cfg.train_hash:
            diff = _diff(old.to_dict(), cfg.to_dict())
            changed = [d.removeprefix("versions.") for d in diff if d.startswith("versions.")]
            # train.num_steps: auto, counted from the data (recorded beside the versions): it follows them
            counted = any(c.startswith("train.num_steps:") for c in changed)
            follows = [d for d in diff if counted and d.startswith("train.num_steps:")]
            if changed and len(changed) + len(follows) == len(diff):  # same config, new content
                raise ConfigError(
                    f"run {cfg.name!r} at {cfg.run_url} was started on other inputs: "
                    f"{'; '.join(changed)} (the source changed since); set run_name to a new name "
                    "(e.g. with the date), or run_name: null to name runs by their config and inputs"
                )
            raise ConfigError(
                f"run {cfg.name!r} at {cfg.run_url} was started with another config "
                f"(different: {', '.join(diff[:8])}); set run_name to a new name, or run_name: null "
                "to name runs by their config"
            )
    hashes = {"data": cfg.data_hash, "train": cfg.train_hash, "eval": cfg.eval_hash}
    root.write_json("config.json", dict(cfg.to_dict(), hashes=hashes))
    return root


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{path}.{k}".lstrip("."))]
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"]
