"""Ready-made runs: the embedded default (tiny preset on the synthetic reverse task).

A recipe is a plain dict of config sections, so the CLI can load YAML over it and apply
`--set key=value` overrides before anything is validated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_core.config import ConfigError, TrainConfig
from grpo_core.model import CausalLM, create_model
from grpo_core.presets import get_preset
from grpo_core.rewards import Reward
from grpo_core.synthetic import CharTokenizer, ReverseTask, char_match, exact_match

SYNTHETIC_DEFAULT: dict[str, Any] = {
    "model": {"preset": "tiny", "seed": 0},
    "task": {"alphabet": "abcde", "min_len": 3, "max_len": 3, "seed": 0},
    "eval_rows": 128,
    "train": {
        "num_steps": 800,
        "seed": 0,
        "grpo": {"num_generations": 8, "prompts_per_step": 16, "loss_aggregation": "token_mean"},
        "sampling": {"max_new_tokens": 6, "temperature": 1.0},
        "optimizer": {"learning_rate": 5e-4, "warmup_steps": 5, "max_grad_norm": 1.0},
    },
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
    mc = get_preset(preset, **{"vocab_size": tok.vocab_size, **model_cfg})
    if mc.vocab_size < tok.vocab_size:
        raise ConfigError(f"model.vocab_size ({mc.vocab_size}) is smaller than the tokenizer's ({tok.vocab_size})")
    task = ReverseTask(**cfg.get("task", {}))
    train = TrainConfig.from_dict(cfg.get("train", {}))
    n_eval = int(cfg.get("eval_rows", 128))
    return SyntheticRun(
        model=create_model(mc, seed), train=train, tokenizer=tok, task=task,
        rewards=[Reward(char_match), Reward(exact_match, weight=0.0)],  # weight 0: reported, not optimised
        eval_rewards=[Reward(exact_match), Reward(char_match)],
        eval_rows=task.eval_rows(n_eval),
    )
