"""Code given as Python objects (a notebook's cell, a script: flows.notebook), carried to the workers
by value: reward functions, tool functions and environment classes. Each is pickled with
cloudpickle into a folder of the storage root named by its digest, beside its source text, and a
config names it `{folder}/{name}.pkl:{name}`.

- The digest is of what the object does, not of how Python lays it out in memory: a function's
  source text (or, without one, its code), and what it reaches by name (the globals its code
  names, its closure, its defaults), recursively for the functions among them; a class's text and
  its members (its methods, and so what they reach), which is also what a class defined in a
  notebook has where Python keeps no text of it. Re-running the same cell in a new kernel gives
  the same digest (a pickle's bytes would not: they name the cell's temporary file), so the same
  config resumes its run; an edit of the function's or the class's text is a new digest, so a new
  spec, a new training hash and a new run.
- The pickle is written once: a folder named by the digest holds one object for good.
- Such code is local-only: unpickling runs code, so a deployment run never loads one (the trust
  policy, grpo_core.rewards.trust, refuses any spec naming a `.pkl`, in rewards, train.agent.tools
  and train.agent.environment alike).

The folders lie under storage.root (`_inputs/rewards/{digest}/`, `_inputs/tools/...`,
`_inputs/environments/...`), not in the run root: the run's folder is named by the training hash,
which the spec holds.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import pickle
import posixpath
import sys
import sysconfig
import textwrap
import types
from typing import Any, Callable

from grpo_core.config.run import PICKLED  # a reward spec whose file part ends so names a pickled callable
from grpo_core.data.in_memory import INPUTS
from grpo_core.store.root import RunRoot


def is_pickled(spec: str) -> bool:
    """Whether a code spec (`rewards[].function`, `train.agent.tools[i]`, `train.agent.environment`)
    names a pickled object: code by value."""
    where = spec.rsplit(":", 1)[0] if ":" in spec else ""
    return where.endswith(PICKLED)


# What a pickled object is, and the folder of `{storage.root}/_inputs/` that holds its kind
KINDS = {"reward": "rewards", "tool": "tools", "environment": "environments"}


def reward_name(fn: Callable, index: int = 0, what: str = "reward") -> str:
    """The name a callable is reported under (metrics `rewards/{name}/mean`, eval.accuracy_reward;
    a tool's name is its function's own): its __name__ where that is an identifier (not a
    lambda's), else {what}_{index}."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(target, "__name__", "") or type(target).__name__
    return name if name.isidentifier() else f"{what}_{index}"


def save_reward(fn: Callable, storage_url: str, name: str) -> str:
    """Pickle reward `fn` by value under `storage_url`: save_code's spec for it."""
    return save_code(fn, storage_url, name, "reward")


def save_code(obj: Any, storage_url: str, name: str, what: str = "reward") -> str:
    """Pickle `obj` (a reward or tool function, an environment class) by value under `storage_url`
    (written once per digest) with its source text; return the spec that names it:
    `{storage_url}/_inputs/{kind}/{digest}/{name}.pkl:{name}`."""
    if what == "environment" and not inspect.isclass(obj):
        raise TypeError(f"environment {name!r} is a {type(obj).__name__}, not a class")
    if what != "environment" and (not callable(obj) or inspect.isclass(obj)):
        raise TypeError(f"{what} {name!r} is a {type(obj).__name__}, not a function")
    folder = RunRoot(posixpath.join(storage_url, INPUTS, KINDS[what], digest(obj)))
    rel = f"{name}{PICKLED}"
    if not folder.exists(rel):
        source = _source(obj) or _members_source(obj) or "# (no source text: defined where Python keeps none)\n"
        header = f"# {name}: the source of the pickled {what} beside this file ({rel}), which is what runs\n"
        folder.write_bytes(f"{name}.py", (header + source).encode())
        folder.write_bytes(rel, _dumps(obj))  # last: its presence says the folder is whole
    return f"{folder.uri(rel)}:{name}"


def load_pickled(where: str, spec: str, what: str = "reward") -> Any:
    """The object pickled at `where` (a local path or a URL). FileNotFoundError when it is not
    there; ImportError when it cannot be unpickled here (a module it needs is missing)."""
    folder, rel = where.rsplit("/", 1) if "/" in where else (".", where)
    data = RunRoot(folder).read_bytes(rel)  # FileNotFoundError names the URI
    try:
        return pickle.loads(data)  # cloudpickle's output: plain pickle, cloudpickle's helpers by reference
    except Exception as exc:  # noqa: BLE001 - whatever unpickling the user's objects raises
        raise ImportError(
            f"{what} {spec!r}: the pickled object cannot be loaded in this environment "
            f"({type(exc).__name__}: {exc}); the interpreter that runs the workers needs the modules it uses"
        ) from exc


def _dumps(fn: Any) -> bytes:
    """cloudpickle of `fn`, its own module by value too (a function or class of an importable module
    would otherwise travel by reference, and the worker might not import that module, or another
    version). A class of `__main__` (a notebook's, a script's) travels by value as a function does."""
    import cloudpickle  # Prefect's dependency, also the project's; only the writer needs it

    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    by_value = module is not None and module.__name__ not in ("__main__", "builtins")
    if by_value:
        try:
            cloudpickle.register_pickle_by_value(module)
        except ValueError:  # not registrable (a module not importable by its name)
            by_value = False
    try:
        return cloudpickle.dumps(fn)
    except Exception:  # noqa: BLE001 - a module-level object that cannot be pickled: by reference then
        if not by_value:
            raise
        cloudpickle.unregister_pickle_by_value(module)
        by_value = False
        return cloudpickle.dumps(fn)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def digest(fn: Any) -> str:
    """16 hex digits of what `fn` does (see the module's doc)."""
    h = hashlib.sha256()
    _feed(h, fn, set(), 0)
    return h.hexdigest()[:16]


def _source(obj: Any) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):  # defined by exec, or a builtin
        return None


def _feed(h: "hashlib._Hash", obj: Any, seen: set[int], depth: int) -> None:
    """Feed what `obj` does into `h`: a function's text and what it reaches, a partial's function
    and arguments, a callable object's class text and state, a module's name, a container's items,
    a value's pickle."""
    if obj is None or isinstance(obj, (str, bytes, int, float, complex)):  # bool is an int
        h.update(f"<{type(obj).__name__} {obj!r}>".encode())
        return
    if id(obj) in seen or depth > 12:  # a function that calls itself, a list that holds itself
        h.update(b"<again>")
        return
    seen.add(id(obj))
    if isinstance(obj, types.ModuleType):
        h.update(f"<module {obj.__name__}>".encode())
    elif isinstance(obj, (list, tuple, dict)):
        h.update(f"<{type(obj).__name__} {len(obj)}>".encode())
        for item in obj.items() if isinstance(obj, dict) else obj:
            _feed(h, item, seen, depth + 1)
    elif isinstance(obj, (set, frozenset)):  # in a stable order: a set of strings iterates by their hashes
        h.update(f"<{type(obj).__name__}>".encode() + b"".join(sorted(_value_bytes(x) for x in obj)))
    elif isinstance(obj, functools.partial):
        h.update(b"<partial>")
        for part in (obj.func, obj.args, obj.keywords):
            _feed(h, part, seen, depth + 1)
    elif isinstance(obj, (types.FunctionType, types.MethodType)):
        fn = obj.__func__ if isinstance(obj, types.MethodType) else obj
        h.update(f"<function {fn.__qualname__}>".encode())
        h.update((_source(fn) or _code_text(fn.__code__)).encode())
        for name in sorted(_names(fn.__code__)):
            if name in fn.__globals__:
                h.update(f"<global {name}>".encode())
                _feed(h, fn.__globals__[name], seen, depth + 1)
        for cell in fn.__closure__ or ():
            try:
                _feed(h, cell.cell_contents, seen, depth + 1)
            except ValueError:  # an empty cell
                h.update(b"<empty>")
        _feed(h, (fn.__defaults__, fn.__kwdefaults__), seen, depth + 1)
    elif isinstance(obj, type):
        h.update(f"<class {obj.__module__}.{obj.__qualname__}>".encode())
        h.update((_source(obj) or "").encode())
        if _users(obj):  # its bases and members: what its methods reach, which its text does not show
            for base in obj.__bases__:
                if base is not object:
                    _feed(h, base, seen, depth + 1)
            for name, member in _members(obj):
                h.update(f"<member {name}>".encode())
                _feed(h, member, seen, depth + 1)
    elif callable(obj) and not isinstance(obj, types.BuiltinFunctionType):  # an object with __call__
        _feed(h, type(obj), seen, depth + 1)
        _feed(h, getattr(obj, "__dict__", None), seen, depth + 1)
    else:
        h.update(_value_bytes(obj))


# a class's own entries that say nothing about what it does (its text says the docstring)
_CLASS_BOOKKEEPING = frozenset({"__dict__", "__weakref__", "__module__", "__qualname__", "__doc__", "__firstlineno__"})
_LIBRARY = tuple(
    sorted({p for k in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_paths().get(k))})
)


def _users(cls: type) -> bool:
    """Whether `cls` is the user's (a notebook's, a script's, a module of theirs), not the standard
    library's or an installed package's, whose text and name stand for it."""
    if cls.__module__ in ("__main__", "builtins"):  # a notebook's or a script's (whatever runs as __main__)
        return cls.__module__ == "__main__"
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)  # none: a class loaded by value
    return path is None or not str(path).startswith(_LIBRARY)


def _members(cls: type) -> list[tuple[str, Any]]:
    """A class's own members, by name: methods as their functions (a staticmethod's, a
    classmethod's, a property's accessors), other values as they are."""
    out = []
    for name, member in sorted(vars(cls).items()):
        if name in _CLASS_BOOKKEEPING:
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        elif isinstance(member, property):
            member = (member.fget, member.fset, member.fdel)
        out.append((name, member))
    return out


def _members_source(obj: Any) -> str | None:
    """A class's methods' source texts, where Python keeps none of the class itself (a notebook's)."""
    if not inspect.isclass(obj):
        return None
    texts = [_source(m) for _, m in _members(obj) if isinstance(m, types.FunctionType)]
    body = "\n".join(textwrap.indent(t, "    ") for t in texts if t)
    return f"class {obj.__name__}:  # its methods' text (Python kept none of the class)\n{body}" if body else None


def _names(code: types.CodeType) -> set[str]:
    """The global names `code` and the code nested in it (lambdas, comprehensions) load."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


def _code_text(code: types.CodeType) -> str:
    """A code object's instructions and constants, without where it was defined (no source)."""
    consts = [_code_text(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return repr((code.co_code, consts, code.co_names, code.co_varnames))


def _value_bytes(value: Any) -> bytes:
    """A plain value as bytes: its pickle (equal values, equal bytes), else its type and repr."""
    try:
        return pickle.dumps(value, protocol=4)
    except Exception:  # noqa: BLE001 - a value pickle refuses (a lock, a generator)
        return f"<{type(value).__qualname__} {value!r}>".encode()
