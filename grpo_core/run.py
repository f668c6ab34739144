"""From a RunConfig to the objects a worker needs: tokenizer, policy, reward functions, and the
prepared prompts read back from the run root. Stage code (training, evaluation) starts here."""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_core.config import ConfigError
from grpo_core.rewards import Reward, RewardFn, load_reward
from grpo_core.run_config import RewardSpec, RunConfig
from grpo_core.storage import RunRoot


def builtin_rewards() -> dict[str, RewardFn]:
    """Reward functions usable by name in a config: the synthetic task's, and the math ones
    (math_answer, think_format, integer_answer) that read data.format's ground_truth column."""
    from grpo_core import math_rewards
    from grpo_core.synthetic import char_match, exact_match

    return {"char_match": char_match, "exact_match": exact_match, **math_rewards.BUILTIN}


def make_rewards(specs: tuple[RewardSpec, ...], field: str = "rewards") -> list[Reward]:
    """Resolve each spec (a built-in name or `file.py:fn` / `module:fn`), or ConfigError naming it."""
    builtins, out = builtin_rewards(), []
    for i, spec in enumerate(specs):
        if spec.function in builtins:
            fn = builtins[spec.function]
        elif ":" not in spec.function:
            raise ConfigError(f"{field}[{i}].function {spec.function!r} is not a built-in reward "
                              f"({', '.join(sorted(builtins))}) nor 'path/to/file.py:function' / 'module:function'")
        else:
            try:
                fn = load_reward(spec.function)
            except (ValueError, ImportError, FileNotFoundError, AttributeError, TypeError, SyntaxError) as exc:
                raise ConfigError(f"{field}[{i}].function: {exc}") from None
        name = spec.function.rsplit(":", 1)[-1]
        out.append(Reward(fn, weight=spec.weight, name=name))
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"{field}: reward names must be unique, got {names}")
    return out


def make_tokenizer(cfg: RunConfig):
    """The tokenizer named by model.tokenizer: 'char' (the built-in character tokenizer), 'auto'
    (AutoTokenizer of model.path, with its generation config's stop ids) or another HF id/folder."""
    from grpo_core.synthetic import CharTokenizer

    if cfg.tokenizer_source is None:
        return CharTokenizer()
    from grpo_core.sources import load_tokenizer

    rev = cfg.model.get("revision") if cfg.tokenizer_source == cfg.model_path else None
    return load_tokenizer(cfg.tokenizer_source, rev)


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
        if self.cfg.model.get("lora"):
            from grpo_core import lora

            lora.apply(model, lora.LoraConfig.from_value(self.cfg.model["lora"]), int(self.cfg.model.get("seed", 0)))
        return model

    def _base_policy(self, placement=None):
        from grpo_core.model import create_model

        mc = self.model_config()
        if mc.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(f"model.vocab_size ({mc.vocab_size}) is smaller than the tokenizer's "
                              f"({self.tokenizer.vocab_size})")
        if self.cfg.model_path:
            from grpo_core.hf import load_hf_model
            from grpo_core.sources import resolve

            overrides = {k: v for k, v in self.cfg.model.items() if k in ("dtype", "param_dtype")}
            return load_hf_model(resolve(self.cfg.model_path, self.cfg.model.get("revision")), placement=placement,
                                 **overrides)
        return create_model(mc, int(self.cfg.model.get("seed", 0)))


def open_run(cfg: RunConfig, root: RunRoot) -> RunParts:
    """Everything a stage needs, with the prepared data read from `data/{hash}` of the run root."""
    from grpo_core.data import load_prepared

    tokenizer = make_tokenizer(cfg)
    rewards = make_rewards(cfg.rewards)
    eval_rewards = make_rewards(cfg.eval_rewards, "eval.rewards" if cfg.eval.rewards else "rewards")
    if cfg.eval.accuracy_reward not in [r.name for r in eval_rewards]:
        raise ConfigError(f"eval.accuracy_reward {cfg.eval.accuracy_reward!r} is not one of the eval rewards "
                          f"{[r.name for r in eval_rewards]}")
    train_rows, eval_rows = load_prepared(root, cfg.data_hash)
    return RunParts(cfg, root, tokenizer, rewards, eval_rewards, train_rows, eval_rows)


def init_run_root(cfg: RunConfig) -> RunRoot:
    """Write the validated config (and its stage hashes) to {run}/config.json. A run folder that
    already holds a config with another training hash is refused: its checkpoints are not ours."""
    root = RunRoot(cfg.run_url)
    if root.exists("config.json"):
        old = RunConfig.from_dict(root.read_json("config.json"))
        if old.train_hash != cfg.train_hash:
            diff = _diff(old.to_dict(), cfg.to_dict())
            raise ConfigError(f"run {cfg.name!r} at {cfg.run_url} was started with another config "
                              f"(different: {', '.join(diff[:8])}); set run_name to a new name, or run_name: null "
                              "to name runs by their config")
    hashes = {"data": cfg.data_hash, "train": cfg.train_hash, "eval": cfg.eval_hash}
    root.write_json("config.json", dict(cfg.to_dict(), hashes=hashes))
    return root


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{path}.{k}".lstrip("."))]
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"]
