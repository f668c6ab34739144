"""Reward functions by name: the built-ins, and `file.py:fn` / `module:fn` resolved for a config's
`rewards` (or `eval.rewards`) list."""

from __future__ import annotations

import functools
import inspect

from grpo_core.agent.builtin import tool_called
from grpo_core.config.run import RewardSpec, RunConfig
from grpo_core.data.synthetic import char_match, exact_match
from grpo_core.errors import ConfigError
from grpo_core.rewards import math_answer as math_rewards
from grpo_core.rewards.functions import Reward, RewardFn, load_reward, soft_overlong
from grpo_core.rewards.reward_model import ModelReward


def builtin_rewards() -> dict[str, RewardFn]:
    """Reward functions usable by name in a config: the synthetic task's, the math ones
    (math_answer, think_format, integer_answer) that read data.format's ground_truth column, and
    tool_called for episodes (train.agent)."""
    return {
        "char_match": char_match,
        "exact_match": exact_match,
        "soft_overlong": soft_overlong,
        **math_rewards.BUILTIN,
        "tool_called": tool_called,
    }


def make_rewards(specs: tuple[RewardSpec, ...], field: str = "rewards", skip_missing: bool = False) -> list[Reward]:
    """Resolve each spec (a built-in name, `file.py:fn` / `module:fn`, or a reward model, whose
    config.json is read: a one-label sequence classifier of a supported architecture), or
    ConfigError naming it. `skip_missing`: leave out a spec whose file, module or model folder
    cannot be found or imported here (it may exist where the workers run: another host); a
    missing function or a wrong signature is still an error."""
    builtins, out = builtin_rewards(), []
    for i, spec in enumerate(specs):
        if spec.model is not None:
            model = ModelReward(spec, f"{field}[{i}].model")
            if skip_missing and model.missing_here():
                continue
            model.config()  # its config.json, small files only: not a classifier fails now, naming the field
            out.append(
                Reward(model, weight=spec.weight, name=spec.name, field=model.field, spec=spec.model, model=True)
            )
            continue
        where = f"{field}[{i}].function"
        builtin = spec.function in builtins
        if builtin:
            fn = builtins[spec.function]
        elif ":" not in spec.function:
            raise ConfigError(
                f"{where} {spec.function!r} is not a built-in reward "
                f"({', '.join(sorted(builtins))}) nor 'path/to/file.py:function' / 'module:function'"
            )
        else:
            try:
                fn = load_reward(spec.function)
            except (ImportError, FileNotFoundError) as exc:
                if skip_missing:
                    continue
                raise ConfigError(f"{where}: {exc}") from None
            except (ValueError, AttributeError, TypeError, SyntaxError) as exc:
                raise ConfigError(f"{where}: {exc}") from None
        name = spec.function.rsplit(":", 1)[-1]
        if spec.params:  # a built-in's settings (soft_overlong's lengths) or a user function's keywords
            fn = _with_params(fn, dict(spec.params), f"{field}[{i}].params", name)
        out.append(Reward(fn, weight=spec.weight, name=name, field=where, spec=spec.function, builtin=builtin))
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"{field}: reward names must be unique, got {names}")
    return out


def _with_params(fn: RewardFn, params: dict, where: str, name: str) -> RewardFn:
    """fn with `params` bound as keywords, checked against its signature now (ConfigError naming
    `where`): a keyword it does not take, or a required one left out."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        ps = sig.parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in ps.values())
        unknown = [k for k in params if k not in ps and not takes_any]
        if unknown:
            raise ConfigError(f"{where}: {name!r} takes no keyword {', '.join(map(repr, unknown))}; it takes {sig}")
        required = getattr(fn, "REQUIRED_PARAMS", ())
        missing = [k for k in required if k not in params]
        if missing:
            raise ConfigError(f"{where}: {name!r} needs {', '.join(map(repr, missing))} (e.g. {fn.PARAMS_EXAMPLE})")
    bound = functools.partial(fn, **params)
    functools.update_wrapper(bound, fn)
    return bound


def config_rewards(cfg: RunConfig, skip_missing: bool = False) -> tuple[list[Reward], list[Reward]]:
    """(training rewards, evaluation rewards) of a run config, resolved as its workers resolve
    them (grpo_core.stages.parts.open_run): ConfigError naming `rewards[i].function` or
    `eval.rewards[i].function` for a file that is missing or fails to import, a missing
    function, or one whose signature cannot take (prompts, completions, **columns)."""
    train = make_rewards(cfg.rewards, skip_missing=skip_missing)
    evals = make_rewards(cfg.eval_rewards, "eval.rewards" if cfg.eval.rewards else "rewards", skip_missing)
    owned = environment_reward(cfg)
    if owned is not None:  # the environment scores its episodes itself (TRL's get_reward), weight 1
        train, evals = [*train, owned], [*evals, owned]
    return train, evals


def environment_reward(cfg: RunConfig) -> Reward | None:
    """The reward of an environment with get_reward() (train.agent.environment), named after its
    class as TRL logs it: each episode's own instance scores it, after the episode ends."""
    agent = cfg.train.agent
    if agent.environment is None:
        return None
    from grpo_core.agent.tools import load_toolbox  # the environment's class, loaded as the workers load it

    box = load_toolbox(agent)
    if not box.owns_reward:
        return None

    def get_reward(prompts, completions, environments, **_):
        return [env.get_reward() for env in environments]

    name = box.env_class.__name__
    return Reward(get_reward, weight=1.0, name=name, field="train.agent.environment", spec=agent.environment)
