"""Loading the code a config names: `path/to/file.py:name`, `package.module:name`, or a callable
pickled by value (grpo_core.rewards.by_value). Rewards, tools and environments load through it
(grpo_core.rewards.functions, grpo_core.agent.tools); errors say which part is wrong and, for a
user's file that fails to import, the line."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import pathlib
import sys
import traceback
from typing import Any

from grpo_core.rewards.by_value import is_pickled, load_pickled


def load_code(spec: str, what: str = "reward") -> Any:
    """The object `spec` names (`path/to/file.py:name`, `package.module:name`, or a callable
    pickled by value), `what` (reward, tool, environment) saying what it is in messages: ValueError
    (the spec), FileNotFoundError, ImportError (with the user's line), AttributeError."""
    if ":" not in spec:
        raise ValueError(f"{what} spec {spec!r} must look like 'path/to/file.py:function' or 'module:function'")
    where, name = spec.rsplit(":", 1)
    if not where or not name.isidentifier():
        raise ValueError(f"{what} spec {spec!r} must look like 'path/to/file.py:function' or 'module:function'")
    if is_pickled(spec):
        return load_pickled(where, spec, what)
    module = _load_file(where, spec, what) if where.endswith(".py") else _import(where, spec, what)
    if not hasattr(module, name):
        defined = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise AttributeError(
            f"{what} {spec!r}: {where} has no {'class' if what == 'environment' else 'function'} {name!r}"
            + (f"; it defines {', '.join(defined)}" if defined else "")
        )
    return getattr(module, name)


def _load_file(where: str, spec: str, what: str = "reward"):
    path = pathlib.Path(where)
    if not path.is_file():
        raise FileNotFoundError(
            f"{what} file {where!r} (from {spec!r}) does not exist"
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
        raise ImportError(f"{what} file {where!r} (from {spec!r}) fails to import: {_why(exc, str(path))}") from exc
    return module


def _import(where: str, spec: str, what: str = "reward"):
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name == where or where.startswith(f"{exc.name}."):
            raise ImportError(
                f"{what} module {where!r} (from {spec!r}) is not installed or not on sys.path "
                "(for a file give its path ending in .py)"
            ) from exc
        raise ImportError(f"{what} module {where!r} (from {spec!r}) fails to import: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a user's module: whatever its top level raises
        try:
            origin = importlib.util.find_spec(where).origin
        except Exception:  # noqa: BLE001
            origin = None
        raise ImportError(f"{what} module {where!r} (from {spec!r}) fails to import: {_why(exc, origin)}") from exc


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
