"""A run's config resolved once, in one place, before the run is named: every fact about the
world the config depends on is read here, from the layers below, and written into the config,
which is then the record the stages receive (init_run writes it to config.json; each stage's
load_run reads it back; nothing downstream resolves any of it again):

1. the architecture of model.path (its config.json: missing or unsupported fails here, naming
   the field) — grpo_core.store.sources
2. the versions of the sources and the code it names (a file rewritten in place, an object
   uploaded again, a Hub repository that moved on, an edited reward file: a new version) —
   grpo_core.store.versions
3. model.init_from pinned to one run and step, or to this config's own copy of it where that run
   is gone — grpo_core.store.startpoint
4. default rewards the data's first row decides (a reference answer: math_answer; none: a
   refusal naming `rewards`) — grpo_core.data.prepare and grpo_core.config.recipes
5. train.num_steps: auto made a number from the training rows the data holds (read, rendered and
   tokenized as preparation will; counted once per data hash) — grpo_core.data.prepare

Each step calls down; neither grpo_core.data nor grpo_core.store calls back up here. `grpo run`,
`grpo check`, the notebook, the flows and the flow-run names all resolve through resolve_run,
so what check reports is what run will do. grpo_core.config stays data.
"""

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
from grpo_core.store.startpoint import pin
from grpo_core.store.versions import source_versions

Warn = Callable[[str], None]


def resolve_run(cfg: RunConfig, warn: Warn | None = None) -> RunConfig:
    """`cfg` resolved (steps 1-5 above): the record of the run it names. `warn` hears what
    resolving noticed but does not refuse (an unresolved Hub revision, a pattern that matches no
    finished run yet, a start point gone but copied)."""
    model_config(cfg)  # 1: the checkpoint's architecture (read once, small files only)
    versions = source_versions(cfg, warn)  # 2
    start = pin(cfg, versions, warn)  # 3: after the sources, whose versions find this config's own copy
    if start is not None:
        versions["model.init_from"] = start
    cfg = dataclasses.replace(cfg, versions=tuple(sorted(versions.items())))
    cfg = _decide_rewards(cfg)  # 4
    return _count_steps(cfg)  # 5: keyed by the data hash, which the versions are part of


def _decide_rewards(cfg: RunConfig) -> RunConfig:
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


def _count_steps(cfg: RunConfig) -> RunConfig:
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
