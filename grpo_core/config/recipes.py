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
from grpo_core.errors import ConfigError

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


# -- rewards that fit the data (issue 53, item 1) ------------------------------------------------
# The synthetic task's rewards (char_match, exact_match) compare with its `answer` column: on the
# user's data they scored GSM8K's whole worked solution. Without `rewards`, data that carries a
# reference answer (a ground_truth column: data.format gsm8k or verl, or one data.rename names)
# gets math_answer, as TRL's and verl's GSM8K examples do, and the format reward when the prompt
# asks for <think>/<answer> tags (recipes/gsm8k-*.yaml's 0.2); data without one is refused.
MATH_REWARD = {"function": "math_answer", "weight": 1.0}
FORMAT_REWARD = {"function": "think_format", "weight": 0.2}  # recipes/gsm8k-*.yaml's weight
# Built-ins that need no reference answer, named when prompt-only data sets no rewards.
NO_REFERENCE_BUILTINS = (
    "think_format (the <think>/<answer> layout)",
    "integer_answer (the final answer is an integer)",
    "soft_overlong (DAPO's length penalty, with params)",
)


@dataclasses.dataclass(frozen=True)
class RewardChoice:
    """Rewards a recipe chose because the config sets none. `why`: as `grpo check` prints it.
    `pending`: data.format leaves open whether the rows carry a reference answer, which their
    first row decides before the run is named (grpo_core.resolve)."""

    specs: tuple[dict, ...]
    why: str
    pending: bool = False

    def describe(self) -> list[str]:
        """['math_answer', 'think_format (weight 0.2)']: the value `grpo check` shows."""
        return [s["function"] + ("" if s["weight"] == 1.0 else f" (weight {s['weight']:g})") for s in self.specs]


def _asks_for_tags(data: dict[str, Any]) -> bool:
    """Whether the prompt asks for <think>...</think><answer>...</answer> (data.system_prompt or
    data.template names both tags): then think_format scores what it asks for."""
    text = " ".join(str(data.get(k) or "") for k in ("system_prompt", "template"))
    return "<think>" in text and "<answer>" in text


def math_rewards(data: dict[str, Any], why: str, pending: bool = False) -> RewardChoice:
    """math_answer, and think_format where the prompt asks for its tags."""
    specs = (MATH_REWARD, FORMAT_REWARD) if _asks_for_tags(data) else (MATH_REWARD,)
    if len(specs) > 1:
        why += "; think_format: the prompt asks for <think>/<answer> tags"
    return RewardChoice(specs, why, pending)


def default_rewards(given: dict[str, Any]) -> RewardChoice | None:
    """The rewards for a config that sets none, on the user's data; None where the config sets
    them or runs the synthetic task (its own, DEFAULT's). What data.format and data.rename say
    decides now; otherwise (auto, plain) the data's first row does (`pending`)."""
    data = given.get("data") if isinstance(given.get("data"), dict) else {}
    if given.get("rewards") or data.get("source", "synthetic") == "synthetic":
        return None
    fmt = str(getattr(data.get("format"), "value", data.get("format") or "auto"))
    if fmt in ("gsm8k", "verl"):
        what = "the number after '####'" if fmt == "gsm8k" else "reward_model.ground_truth"
        return math_rewards(data, f"data.format {fmt}: a reference answer in every row ({what})")
    renamed = [k for k, v in (data.get("rename") or {}).items() if v == "ground_truth"]
    if renamed:
        return math_rewards(data, f"data.rename maps {renamed[0]!r} to ground_truth, the reference answer")
    return math_rewards(data, f"data.format {fmt}: the data's first row decides", pending=True)


def rewards_for_rows(data: dict[str, Any], fmt: str, columns: list[str], source: str) -> RewardChoice:
    """The rewards for data read as `fmt` whose first row (renamed, in its format) has `columns`:
    math_answer where one is ground_truth, else ConfigError naming `rewards` and the built-ins
    that need no reference answer."""
    if "ground_truth" in columns:
        how = f"ground_truth from its {fmt} rows"
        if fmt == "plain":
            how = "ground_truth from its solution column" if "solution" in columns else "a ground_truth column"
        return math_rewards(data, f"data.source reads as {fmt}: {how}, the reference answer")
    answers = [c for c in columns if c in ("answer", "solution", "target", "label", "reference")]
    hint = ""
    if answers:
        column = answers[0]
        hint = f"; to score against its {column!r} column: data.rename={{{column}: ground_truth}} for math_answer"
        if answers[0] == "answer":  # what exact_match and char_match read
            hint += " (a number or expression), or rewards=[exact_match] (the text itself, as the synthetic task's)"
    raise ConfigError(
        f"rewards: none set, and data.source {source} (read as {fmt}; columns: {', '.join(sorted(columns))}) has no "
        f"reference answer to score against, so no reward fits by default. Set rewards, e.g. "
        f"--set 'rewards=[path/to/rewards.py:my_reward]'. Built-ins that need no reference answer: "
        f"{', '.join(NO_REFERENCE_BUILTINS)}; math_answer needs a ground_truth column (data.format gsm8k or "
        f"verl, or data.rename={{answer column: ground_truth}}){hint}"
    )


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
    filled.update(_explain_rewards(given, default))
    return {"recipe": recipe.name, "why": recipe.why, "filled": filled}


def _explain_rewards(given: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    """The rewards and eval.accuracy_reward where the config sets none, and why."""
    if given.get("rewards"):
        return {}
    chosen = default_rewards(given)
    if chosen is None:  # the synthetic task's own
        where = "the synthetic task's rewards (grpo_core/config/run.py DEFAULT)"
        specs, accuracy = default["rewards"], default["eval"]["accuracy_reward"]
        value = RewardChoice(tuple(dict({"weight": 1.0}, **s) for s in specs), where).describe()
        out = {"rewards": {"value": value, "source": where}}
    else:
        accuracy, where = MATH_REWARD["function"], "the first reward with a weight above 0"
        out = {"rewards": {"value": chosen.describe(), "source": chosen.why}}
    if not _has(given, "eval.accuracy_reward"):
        out["eval.accuracy_reward"] = {"value": accuracy, "source": where}
    return out


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
