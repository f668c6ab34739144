"""From a RunConfig to the objects a worker needs: tokenizer, policy, reward functions, and the
prepared prompts read back from the run root. Stage code (training, evaluation) starts here."""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_core.config.run import RunConfig
from grpo_core.data.tokenizer import make_tokenizer
from grpo_core.errors import ConfigError
from grpo_core.rewards.functions import Reward
from grpo_core.rewards.registry import make_rewards
from grpo_core.store.root import RunRoot


@dataclasses.dataclass
class RunParts:
    cfg: RunConfig
    root: RunRoot
    tokenizer: Any
    rewards: list[Reward]
    eval_rewards: list[Reward]
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]

    def model_config(self):
        return self.cfg.model_config(vocab_size=self.tokenizer.vocab_size)

    def create_policy(self, placement=None):
        """The starting policy: the checkpoint at model.path, or a preset initialised from
        model.seed, with fresh LoRA adapters when model.lora is set; every process builds the same.
        With a `placement`, checkpoint weights are loaded straight onto its mesh."""
        model = self._base_policy(placement)
        if self.cfg.model.lora is not None:
            from grpo_core.nn import lora

            lora.apply(model, self.cfg.model.lora, self.cfg.model.seed)
        return model

    def _base_policy(self, placement=None):
        from grpo_core.nn.model import create_model

        mc = self.model_config()
        if mc.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(
                f"model.vocab_size ({mc.vocab_size}) is smaller than the tokenizer's ({self.tokenizer.vocab_size})"
            )
        if self.cfg.model_path:
            from grpo_core.nn.hf import load_hf_model
            from grpo_core.store.sources import resolve

            overrides = {k: v for k, v in self.cfg.model.overrides.items() if k in ("dtype", "param_dtype")}
            return load_hf_model(
                resolve(self.cfg.model_path, self.cfg.model.revision), placement=placement, **overrides
            )
        return create_model(mc, self.cfg.model.seed)


def open_run(cfg: RunConfig, root: RunRoot) -> RunParts:
    """Everything a stage needs, with the prepared data read from `data/{hash}` of the run root."""
    from grpo_core.data.prepare import load_prepared

    tokenizer = make_tokenizer(cfg)
    rewards = make_rewards(cfg.rewards)
    eval_rewards = make_rewards(cfg.eval_rewards, "eval.rewards" if cfg.eval.rewards else "rewards")
    if cfg.eval.accuracy_reward not in [r.name for r in eval_rewards]:
        raise ConfigError(
            f"eval.accuracy_reward {cfg.eval.accuracy_reward!r} is not one of the eval rewards "
            f"{[r.name for r in eval_rewards]}"
        )
    train_rows, eval_rows = load_prepared(root, cfg.data_hash)
    return RunParts(cfg, root, tokenizer, rewards, eval_rewards, train_rows, eval_rows)
