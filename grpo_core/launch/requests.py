"""What a readiness worker is asked: the request for a run config's programs, which the Prefect
side writes for `python -m grpo_core.stages.aot --request FILE` (tasks/readiness.py) and a training
worker compares with the report it finds (grpo_core.stages.worker). Config data, JAX-free: tasks
start workers by command line and read this, never a stage module."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from grpo_core.rewards.reward_model import config_shapes
from grpo_core.store.sources import model_config


def request_for(cfg, vocab_size: int) -> dict[str, Any]:
    """The request for a run config's programs (grpo_core.config.run.RunConfig), for
    pipeline.readiness.target; `vocab_size`: the tokenizer's."""
    train = cfg.train.replace(num_steps=1).to_dict()
    # a synchronous, colocated, single-turn run's request as it was before these fields existed: its key holds
    if train["max_staleness"] == 0:
        del train["max_staleness"]
    for name, default in (("layout", "colocated"), ("devices", None)):
        if train["rollout"][name] == default:
            del train["rollout"][name]
    if not cfg.train.agent.enabled:
        del train["agent"]
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
        # the reward models' trunks and batches, from their config.json (absent without one)
        **({"reward_models": [r.to_dict() for r in rms]} if (rms := config_shapes(cfg)) else {}),
    }


def programs_key(req: dict[str, Any]) -> str:
    """The programs' identity: the request's configs and target (not the compiler's versions)."""
    keys = ("model", "train", "max_prompt_tokens", "eval", "lora", "separate_reference", "programs")
    body = {k: req.get(k) for k in keys} | {"target": req["target"], "num_slices": req.get("num_slices", 1)}
    if req.get("reward_models"):  # absent otherwise: the keys of runs without one hold
        body["reward_models"] = req["reward_models"]
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:24]
