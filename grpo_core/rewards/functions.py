"""Reward functions: `f(prompts, completions, **columns) -> list[float | None]`, the signature
TRL and EasyDeL users already write. Several combine as a weighted sum; `None` means "this
function does not apply to this row" and a row no function applies to is left out of the loss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import math
import pathlib
import sys
import traceback
from typing import Any, Callable, Sequence

import numpy as np

from grpo_core.errors import RewardFunctionError

RewardFn = Callable[..., Sequence[float | None]]


@dataclasses.dataclass(frozen=True)
class Reward:
    fn: RewardFn
    weight: float = 1.0
    name: str = ""

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"reward {self.name or self.fn!r} is not callable")
        if not self.name:
            object.__setattr__(self, "name", getattr(self.fn, "__name__", type(self.fn).__name__))


def _short(text: Any, n: int = 60) -> str:
    s = repr(text)
    return s if len(s) <= n else s[: n - 3] + "..."


def _call_one(reward: Reward, prompts, completions, columns) -> np.ndarray:
    n = len(completions)
    try:
        out = reward.fn(prompts, completions, **columns)
    except Exception as exc:  # noqa: BLE001 - a user's function: report it with the row that fails
        raise RewardFunctionError(_find_bad_row(reward, prompts, completions, columns, exc)) from exc
    try:
        out = list(out)
    except TypeError:
        raise RewardFunctionError(
            f"reward function {reward.name!r} returned {type(out).__name__}, expected a list of {n} floats (or None)"
        ) from None
    if len(out) != n:
        raise RewardFunctionError(f"reward function {reward.name!r} returned {len(out)} values for {n} completions")
    vals = np.empty(n, np.float64)
    for i, v in enumerate(out):
        if v is None:
            vals[i] = np.nan
            continue
        try:
            vals[i] = float(v)
        except (TypeError, ValueError):
            raise RewardFunctionError(
                f"reward function {reward.name!r} returned {_short(v)} for row {i} "
                f"(completion {_short(completions[i])}); expected a float or None"
            ) from None
        if not math.isfinite(vals[i]):
            raise RewardFunctionError(
                f"reward function {reward.name!r} returned {v} for row {i} "
                f"(completion {_short(completions[i])}); use None to skip a row"
            )
    return vals


def _find_bad_row(reward, prompts, completions, columns, exc) -> str:
    """Re-run the failing function row by row to name the first row it raises on."""
    for i in range(len(completions)):
        try:
            reward.fn(prompts[i : i + 1], completions[i : i + 1], **{k: v[i : i + 1] for k, v in columns.items()})
        except Exception as row_exc:  # noqa: BLE001
            return (
                f"reward function {reward.name!r} raised {type(row_exc).__name__}: {row_exc} on row {i} "
                f"(prompt {_short(prompts[i])}, completion {_short(completions[i])})"
            )
    return (
        f"reward function {reward.name!r} raised {type(exc).__name__}: {exc} (on the whole batch of {len(completions)})"
    )


@dataclasses.dataclass
class RewardResult:
    total: np.ndarray  # (B,) weighted sum; NaN where no function applies (row excluded)
    per_function: dict[str, np.ndarray]  # name -> (B,) raw values, NaN where None


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: dict[str, Sequence[Any]] | None = None,
) -> RewardResult:
    columns = {k: list(v) for k, v in (columns or {}).items()}
    for k, v in columns.items():
        if len(v) != len(completions):
            raise ValueError(f"column {k!r} has {len(v)} values for {len(completions)} completions")
    per = {}
    weighted = np.zeros(len(completions))
    applies = np.zeros(len(completions), bool)
    for r in rewards:
        vals = _call_one(r, list(prompts), list(completions), columns)
        per[r.name] = vals
        ok = ~np.isnan(vals)
        weighted += np.where(ok, vals * r.weight, 0.0)
        applies |= ok
    return RewardResult(np.where(applies, weighted, np.nan), per)


def load_reward(spec: str) -> RewardFn:
    """Load `path/to/file.py:function` or `package.module:function`. Errors say which part is
    wrong: ValueError (the spec), FileNotFoundError, ImportError (the module, or code in it that
    fails on import, with the line), AttributeError (no such function), TypeError (not callable,
    or a signature that cannot take (prompts, completions, **columns))."""
    if ":" not in spec:
        raise ValueError(f"reward spec {spec!r} must look like 'path/to/file.py:function' or 'module:function'")
    where, name = spec.rsplit(":", 1)
    if not where or not name.isidentifier():
        raise ValueError(f"reward spec {spec!r} must look like 'path/to/file.py:function' or 'module:function'")
    module = _load_file(where, spec) if where.endswith(".py") else _import(where, spec)
    if not hasattr(module, name):
        defined = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise AttributeError(
            f"reward {spec!r}: {where} has no function {name!r}"
            + (f"; it defines {', '.join(defined)}" if defined else "")
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"reward {spec!r}: {where}.{name} is a {type(fn).__name__}, not a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: let the first call tell
        return fn
    params = sig.parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TypeError(f"reward {spec!r} must accept (prompts, completions, **columns); its signature is {name}{sig}")
    stuck = [p.name for p in positional[2:] if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if stuck:
        raise TypeError(
            f"reward {spec!r}: {name}{sig} takes {', '.join(stuck)} positionally only, but dataset "
            "columns arrive as keywords"
        )
    return fn


def _load_file(where: str, spec: str):
    path = pathlib.Path(where)
    if not path.is_file():
        raise FileNotFoundError(
            f"reward file {where!r} (from {spec!r}) does not exist"
            + (f" (relative to {pathlib.Path.cwd()})" if not path.is_absolute() else "")
        )
    # One module per file (two rewards.py in different folders stay apart), registered while it
    # runs because dataclasses and pickle look a module up by name.
    mod_name = f"_grpo_reward_{path.stem}_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]}"
    mod_spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_name] = module
    try:
        mod_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - a user's file: whatever its top level raises
        sys.modules.pop(mod_name, None)
        raise ImportError(f"reward file {where!r} (from {spec!r}) fails to import: {_why(exc, str(path))}") from exc
    return module


def _import(where: str, spec: str):
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name == where or where.startswith(f"{exc.name}."):
            raise ImportError(
                f"reward module {where!r} (from {spec!r}) is not installed or not on sys.path "
                "(for a file give its path ending in .py)"
            ) from exc
        raise ImportError(f"reward module {where!r} (from {spec!r}) fails to import: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a user's module: whatever its top level raises
        try:
            origin = importlib.util.find_spec(where).origin
        except Exception:  # noqa: BLE001
            origin = None
        raise ImportError(f"reward module {where!r} (from {spec!r}) fails to import: {_why(exc, origin)}") from exc


def _why(exc: Exception, filename: str | None) -> str:
    """'SyntaxError: invalid syntax (rewards.py line 3)', 'NameError: ... (line 7)': the user's line."""
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({pathlib.Path(exc.filename or '?').name} line {exc.lineno})"
    lines = [
        f.lineno
        for f in traceback.extract_tb(exc.__traceback__)
        if filename and pathlib.Path(f.filename).resolve() == pathlib.Path(filename).resolve()
    ]
    return f"{type(exc).__name__}: {exc}" + (f" (line {lines[-1]})" if lines else "")
