"""The embedded default as an in-process engine recipe: the tiny preset on the synthetic reverse
task, built into a model, a TrainConfig, a tokenizer and rewards without a run root."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from grpo_core.config.presets import get_preset
from grpo_core.config.run import DEFAULT
from grpo_core.config.train import TrainConfig
from grpo_core.data.synthetic import CharTokenizer, ReverseTask, char_match, exact_match
from grpo_core.errors import ConfigError
from grpo_core.nn import lora
from grpo_core.nn.model import CausalLM, create_model
from grpo_core.rewards.functions import Reward

# The pipeline's default run (grpo_core.config.run.DEFAULT) in the engine's shape, for driving
# GRPOTrainer in-process (tests, notebooks) without a run root.
SYNTHETIC_DEFAULT: dict[str, Any] = {
    "model": {k: v for k, v in DEFAULT["model"].items() if k != "tokenizer"},
    "task": dict(DEFAULT["data"]["synthetic"]),
    "eval_rows": DEFAULT["data"]["eval_rows"],
    "train": copy.deepcopy(DEFAULT["train"]),
}


@dataclasses.dataclass
class SyntheticRun:
    model: CausalLM
    train: TrainConfig
    tokenizer: CharTokenizer
    task: ReverseTask
    rewards: list[Reward]  # what GRPO optimises
    eval_rewards: list[Reward]  # what evaluation reports; exact_match is the accuracy
    eval_rows: list[dict]


def build_synthetic(cfg: dict[str, Any]) -> SyntheticRun:
    known = {"model", "task", "eval_rows", "train"}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ConfigError(f"unknown config section(s) {unknown}; known: {sorted(known)}")
    tok = CharTokenizer()
    model_cfg = dict(cfg.get("model", {}))
    preset = model_cfg.pop("preset", "tiny")
    seed = model_cfg.pop("seed", 0)
    lora_cfg = model_cfg.pop("lora", None)
    mc = get_preset(preset, **{"vocab_size": tok.vocab_size, **model_cfg})
    if mc.vocab_size < tok.vocab_size:
        raise ConfigError(f"model.vocab_size ({mc.vocab_size}) is smaller than the tokenizer's ({tok.vocab_size})")
    task = ReverseTask(**cfg.get("task", {}))
    train = TrainConfig.from_dict(cfg.get("train", {}))
    n_eval = int(cfg.get("eval_rows", 128))
    model = create_model(mc, seed)
    if lora_cfg:
        lora.apply(model, lora.LoraConfig.from_value(lora_cfg), seed)
    return SyntheticRun(
        model=model,
        train=train,
        tokenizer=tok,
        task=task,
        rewards=[Reward(char_match), Reward(exact_match, weight=0.0)],  # weight 0: reported, not optimised
        eval_rewards=[Reward(exact_match), Reward(char_match)],
        eval_rows=task.eval_rows(n_eval),
    )
