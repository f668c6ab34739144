"""Reward functions by name: the built-ins, and `file.py:fn` / `module:fn` resolved for a config's
`rewards` (or `eval.rewards`) list."""

from __future__ import annotations

from grpo_core.config.run import RewardSpec
from grpo_core.errors import ConfigError
from grpo_core.rewards.functions import Reward, RewardFn, load_reward


def builtin_rewards() -> dict[str, RewardFn]:
    """Reward functions usable by name in a config: the synthetic task's, and the math ones
    (math_answer, think_format, integer_answer) that read data.format's ground_truth column."""
    from grpo_core.data.synthetic import char_match, exact_match
    from grpo_core.rewards import math_answer as math_rewards

    return {"char_match": char_match, "exact_match": exact_match, **math_rewards.BUILTIN}


def make_rewards(specs: tuple[RewardSpec, ...], field: str = "rewards") -> list[Reward]:
    """Resolve each spec (a built-in name or `file.py:fn` / `module:fn`), or ConfigError naming it."""
    builtins, out = builtin_rewards(), []
    for i, spec in enumerate(specs):
        if spec.function in builtins:
            fn = builtins[spec.function]
        elif ":" not in spec.function:
            raise ConfigError(
                f"{field}[{i}].function {spec.function!r} is not a built-in reward "
                f"({', '.join(sorted(builtins))}) nor 'path/to/file.py:function' / 'module:function'"
            )
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
