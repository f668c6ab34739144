"""Which defaults a run starts from, and why (issue 29).

The embedded default (grpo_core.config.run.DEFAULT) is a recipe tuned for the synthetic task on
the tiny preset: 6 new tokens, learning rate 5e-4, an entropy bonus, dynamic sampling. It is
the `synthetic` recipe, and it stays exactly as it is (the demo's hashes are pinned).

A run on the user's data or a real model (`data.source`, `model.path`, a Qwen/Llama preset) gets
the `hf` recipe instead: the defaults users know from TRL's GRPOConfig and verl's GSM8K
examples, each with its source below. A field the user sets always wins; `grpo check` prints
which recipe filled which fields and why (`explain`).

Sources (as published; TRL's are GRPOConfig's and transformers.TrainingArguments' defaults):
- TRL GRPOConfig: learning_rate 1e-6, beta 0.0 (no reference model; 0.04 before TRL 0.19),
  num_generations 8, max_completion_length 256, max_prompt_length 512, temperature 1.0,
  epsilon 0.2 (epsilon_high = epsilon), loss_type "dapo" (token-level normalisation),
  scale_rewards "group"; TrainingArguments: warmup 0, adam_beta2 0.999, weight_decay 0,
  max_grad_norm 1.0.
- verl examples/grpo_trainer/run_qwen2-7b.sh (GSM8K): actor.optim.lr 1e-6, kl_loss_coef 0.001
  (low_var_kl, i.e. k3), entropy_coeff 0, max_prompt_length 512, max_response_length 1024.
- LoRA: Thinking Machines, "LoRA Without Regret" (2025): the best LoRA learning rate is about
  10x the full fine-tuning one, for RL too; Unsloth's GRPO notebooks use 5e-6 to 1e-5.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_core.config.presets import PRESETS

# Presets with a real model's shape (and a real tokenizer's vocabulary): not the demo's.
TEST_PRESETS = ("tiny", "small")
REAL_PRESETS = tuple(n for n in PRESETS if n not in TEST_PRESETS)


@dataclasses.dataclass(frozen=True)
class Default:
    field: str  # dotted path in the run config
    value: Any
    source: str  # where the value comes from, as shown by `grpo check`


# The `hf` recipe: fields over the engine's own defaults (grpo_core.config.train), by source.
HF_DEFAULTS = (
    Default("train.sampling.max_new_tokens", 256, "TRL GRPOConfig.max_completion_length"),
    Default("train.sampling.temperature", 1.0, "TRL GRPOConfig.temperature"),
    Default("train.optimizer.learning_rate", 1e-6, "TRL GRPOConfig.learning_rate; verl GSM8K actor.optim.lr"),
    Default("train.optimizer.warmup_steps", 0, "TRL (TrainingArguments.warmup_ratio 0)"),
    Default("train.optimizer.b2", 0.999, "TRL (TrainingArguments.adam_beta2); verl AdamW betas"),
    Default("train.optimizer.weight_decay", 0.0, "TRL (TrainingArguments.weight_decay)"),
    Default("train.optimizer.max_grad_norm", 1.0, "TRL (TrainingArguments.max_grad_norm); verl grad_clip"),
    Default("train.grpo.num_generations", 8, "TRL GRPOConfig.num_generations"),
    Default(
        "train.grpo.prompts_per_step",
        8,
        "64 completions a step: TRL's per_device_train_batch_size 8 on 8 devices, over num_generations 8",
    ),
    Default("train.grpo.beta", 0.0, "TRL GRPOConfig.beta (0.0 since TRL 0.19: no reference model)"),
    Default("train.grpo.loss_aggregation", "token_mean", "TRL GRPOConfig.loss_type 'dapo'"),
    Default("train.grpo.epsilon_low", 0.2, "TRL GRPOConfig.epsilon"),
    Default("train.grpo.epsilon_high", 0.2, "TRL GRPOConfig.epsilon_high (= epsilon)"),
    Default("train.grpo.scale_rewards", "group", "TRL GRPOConfig.scale_rewards"),
    Default("train.grpo.entropy_coef", 0.0, "verl GSM8K actor.entropy_coeff 0; TRL has no entropy bonus"),
    Default("train.grpo.dynamic_sampling", False, "TRL and verl's GRPO examples (DAPO's recipe turns it on)"),
    Default("train.num_steps", "auto", "TRL (TrainingArguments.max_steps -1): num_epochs passes over the data"),
    Default("train.num_epochs", 3.0, "TRL (TrainingArguments.num_train_epochs)"),
)
HF_DATA_DEFAULTS = (
    Default("data.max_prompt_tokens", 512, "TRL GRPOConfig.max_prompt_length; verl GSM8K max_prompt_length"),
)
HF_LORA_DEFAULTS = (
    Default(
        "train.optimizer.learning_rate",
        1e-5,
        "~10x full fine-tuning's 1e-6 for LoRA (Thinking Machines, LoRA Without Regret, 2025)",
    ),
)


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str  # "synthetic" or "hf"
    why: str  # the field that chose it, in words


def choose(given: dict[str, Any]) -> Recipe:
    """The recipe for what the user gave (the YAML and --set values, before any default)."""
    data, model = given.get("data"), given.get("model")
    data = data if isinstance(data, dict) else {}
    model = model if isinstance(model, dict) else {}
    if data.get("source", "synthetic") != "synthetic":
        return Recipe("hf", "data.source is set")
    if model.get("path"):
        return Recipe("hf", "model.path is set")
    if model.get("preset") in REAL_PRESETS:
        return Recipe("hf", f"model.preset {model['preset']} is a real model's shape")
    return Recipe("synthetic", "the synthetic task on a test preset: the demo's tuned recipe")


def hf_defaults(given: dict[str, Any]) -> tuple[Default, ...]:
    """The `hf` recipe's defaults for this config: LoRA's learning rate with model.lora, the data
    section's on the user's data."""
    model, data = given.get("model"), given.get("data")
    lora = isinstance(model, dict) and model.get("lora") not in (None, False, {})
    own_data = isinstance(data, dict) and data.get("source", "synthetic") != "synthetic"
    out = {d.field: d for d in HF_DEFAULTS + (HF_DATA_DEFAULTS if own_data else ())}
    if lora:
        out.update({d.field: d for d in HF_LORA_DEFAULTS})
    return tuple(out.values())


def apply(base: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """`base` (the embedded default) with the chosen recipe's defaults in place of the synthetic
    task's training recipe; the synthetic recipe leaves it as it is."""
    if choose(given).name == "synthetic":
        return base
    out = dict(base, train={})
    for d in hf_defaults(given):
        _set(out, d.field, d.value)
    return out


def explain(given: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    """Which recipe filled which fields of this config and why: {recipe, why, filled: {field:
    {value, source}}}, the fields the user set left out. `default`: the embedded default."""
    recipe = choose(given)
    if recipe.name == "hf":
        defaults = hf_defaults(given)
    else:
        source = "the synthetic task's tuned recipe (grpo_core/config/run.py DEFAULT)"
        defaults = tuple(Default(f, v, source) for f, v in _flat({"train": default["train"]}))
    filled = {d.field: {"value": d.value, "source": d.source} for d in defaults if not _has(given, d.field)}
    return {"recipe": recipe.name, "why": recipe.why, "filled": filled}


def _set(tree: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def _has(tree: Any, path: str) -> bool:
    for p in path.split("."):
        if not isinstance(tree, dict) or p not in tree:
            return False
        tree = tree[p]
    return True


def _flat(tree: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in tree.items():
        out += _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return out
