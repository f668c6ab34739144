"""A run config resolved against the world: the versions of the sources it names (a file
rewritten in place, an object uploaded again, a Hub repository that moved on: a new version;
grpo_core.store.versions), model.init_from pinned to one run and step
(grpo_core.store.startpoint), the default rewards checked against the data's first row (a
reference answer or a refusal), and train.num_steps: auto made a number from the rows the data
holds. grpo_core.config stays data; this is what fills it in, once, before a run is named."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

from grpo_core.config import recipes
from grpo_core.config.run import RunConfig
from grpo_core.data.prepare import dry_run, first_row_format
from grpo_core.data.tokenizer import make_tokenizer
from grpo_core.errors import ConfigError, DataError
from grpo_core.store.sources import cache_dir, model_config
from grpo_core.store.versions import source_versions


def with_versions(cfg: RunConfig, warn: Callable[[str], None] | None = None) -> RunConfig:
    """`cfg` with the current versions of the sources it names and, with model.init_from, the
    policy it names resolved to one run and step; train.num_steps: auto made a number from the
    data those versions hold (resolve_steps). A model.path whose config.json is missing or of an
    unsupported model fails here, naming the field."""
    model_config(cfg)  # the checkpoint's architecture (read once, small files only)
    cfg = dataclasses.replace(cfg, versions=tuple(sorted(source_versions(cfg, warn).items())))
    return resolve_steps(resolve_rewards(cfg))


def resolve_rewards(cfg: RunConfig) -> RunConfig:
    """`cfg` with default rewards whose fit the data's first row decides (recipes.default_rewards:
    no rewards set, data.format auto or plain, no column renamed to ground_truth) decided:
    math_answer where the rows carry a reference answer, else ConfigError naming `rewards` and
    the built-ins that need none. Data that cannot be read leaves them open: the data stage
    fails naming the row (and its reward probe stops a reward that can score nothing)."""
    chosen = cfg.rewards_default
    if chosen is None or not chosen.pending:
        return cfg
    try:
        fmt, columns = first_row_format(cfg.data)
    except (DataError, ConfigError):
        return cfg
    decided = recipes.rewards_for_rows(cfg.data.to_dict(), fmt, columns, cfg.data.source)
    # the same rewards as the pending choice (both from data.system_prompt / data.template): only
    # the reason is new, so the config's hashes do not move
    return dataclasses.replace(cfg, rewards_default=decided)


def resolve_steps(cfg: RunConfig) -> RunConfig:
    """`cfg` with train.num_steps: auto made a number: train.num_epochs passes over the training
    rows that data preparation will keep (read, rendered and tokenized as it will, nothing
    written; counted once per data hash in the model cache folder). Data the run cannot prepare
    leaves it auto: the data stage then fails naming the row, before any training."""
    if cfg.train.num_steps != "auto":
        return cfg
    where = os.path.join(cache_dir(), "rows", f"{cfg.data_hash}.json")
    try:
        with open(where) as f:
            rows = int(json.load(f)["train_rows"])
    except (OSError, ValueError, KeyError):
        try:
            rows = dry_run(cfg.data, make_tokenizer(cfg))["train_rows"]
        except (DataError, ConfigError):  # the data stage (and grpo check's data check) names the row
            return cfg
        os.makedirs(os.path.dirname(where), exist_ok=True)
        tmp = f"{where}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"train_rows": rows}, f)
        os.replace(tmp, where)
    # recorded beside the sources' versions (config.json): the number follows the data, and a run
    # refused for new data says so (grpo_core.store.runs); in no hash beyond the number itself
    how = dict(cfg.versions, **{"train.num_steps": f"auto: {cfg.train.num_epochs:g} epochs over {rows} rows"})
    train = cfg.train.replace(num_steps=cfg.train.steps_for(rows))
    return dataclasses.replace(cfg, train=train, versions=tuple(sorted(how.items())))
