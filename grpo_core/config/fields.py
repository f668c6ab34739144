"""How a config section is declared, read and checked.

Each field is declared once: its type (coercion of YAML/CLI strings and enum values follows the
type hint), its default, its description and its bounds (`field(8, doc=..., ge=2)`). Validation,
the Prefect form (flows/params.py) and the docs' config reference (docs/hooks/) all read it;
a section adds only the rules that relate several fields (`validate`). Error messages carry
the field's full path, derived from the section's `path` (`train.grpo.num_generations must be
>= 2, got 1`), so a user who mistyped a YAML key or a `--set` override sees what to fix.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import hashlib
import json
import string
import types
import typing
from typing import Any, ClassVar

import yaml

from grpo_core.errors import ConfigError

MISSING = dataclasses.MISSING


def config_hash(fields: dict[str, Any], length: int = 12) -> str:
    """Short stable hash of a config (key order does not matter)."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:length]


_RULES = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


class Trust(enum.Enum):
    """What a field's value names, as the trust policy (grpo_core.rewards.trust) sees it. Every field
    that holds text (a string, a list of strings, a mapping) declares one, so a new field that names
    a place, a program or an address cannot be added unclassified (tests/test_trust.py)."""

    SAFE = "safe"  # names nothing outside the run: a word, a column, a Hub id, a template
    READS = "reads"  # a file, folder or URL the run reads
    WRITES = "writes"  # a folder or URL the run writes into (and removes what it wrote there)
    PROGRAM = "program"  # a program, an interpreter, its arguments or the folder it runs in
    CODE = "code"  # Python code to import and call: path/to/file.py:fn or module:fn
    ADDRESS = "address"  # a host the run connects to, or a remote machine it acts on


def field(
    default: Any = MISSING,
    *,
    doc: str = "",
    factory: Any = MISSING,
    trust: Trust | None = None,
    api_max: int | float | None = None,
    **bounds: Any,
) -> Any:
    """A section field: `default` (or `factory` for a mutable or section default), its description
    and its bounds (ge, gt, le, lt on numbers; min_length on strings and lists). `trust`: what the
    value names (Trust; every text field has one). `api_max`: the most a deployment run may ask for
    (work: rows, steps, processes, batch sizes), which the operator can raise (grpo serve
    --raise-limit); the local user's own config is not bounded by it."""
    unknown = set(bounds) - {*_RULES, "min_length"}
    assert not unknown, f"unknown bound(s) {unknown}"
    meta = {"doc": doc, "bounds": bounds, "trust": trust, "api_max": api_max}
    return dataclasses.field(default=default, default_factory=factory, metadata=meta)


def doc_of(f: dataclasses.Field) -> str:
    return f.metadata.get("doc", "")


def trust_of(f: dataclasses.Field) -> Trust | None:
    return f.metadata.get("trust")


def api_max_of(f: dataclasses.Field) -> int | float | None:
    return f.metadata.get("api_max")


def bounds_of(f: dataclasses.Field) -> dict[str, Any]:
    return dict(f.metadata.get("bounds", {}))


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def as_enum(cls: type[enum.Enum], value: Any, path: str) -> enum.Enum:
    """An enum member from itself or its string value (YAML, CLI overrides)."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(m.value for m in cls)
        raise ConfigError(f"{path} must be one of {choices}; got {value!r}") from None


def placeholders(text: str, what: str, allowed: tuple[str, ...] | None = None, like: str = "") -> list[str]:
    """The names of `text`'s placeholders, where each is a plain `{name}` and nothing more; else
    ConfigError naming `what`, before anything is formatted. A format spec (`{x:>1500000000}`)
    makes str.format allocate that much first (gigabytes from one field), and a nested one
    (`{x:{x.__class__.__mro__}}`) or an attribute, index or conversion (`{x.a}`, `{x[0]}`,
    `{x!r}`) reaches the objects behind a value: a template names values, it computes nothing.
    `allowed`: the only names it may hold (None: any identifier); `like`: what they are, said."""
    try:
        parts = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise ConfigError(f"{what} {_short(text)} is not a valid format string: {exc}") from None
    names, bad = [], []
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if name.isidentifier() and not spec and not conversion and (allowed is None or name in allowed):
            names.append(name)
        else:
            bad.append("{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}")
    if bad:
        raise ConfigError(
            f"{what} {_short(text)}: placeholders must be {like or 'names'}, with no format spec, conversion, "
            f"attribute or index; got {', '.join(_short(b, 40) for b in bad[:4])}"
        )
    return names


def _short(text: str, most: int = 80) -> str:
    """`text` quoted, cut to `most` characters (a config value in a message, whatever its size)."""
    return repr(text if len(text) <= most else text[:most] + "...")


def _parts(hint: Any) -> tuple[Any, bool, tuple[str, ...]]:
    """(the main type, whether null is allowed, the words allowed beside it such as "auto")."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin not in (typing.Union, types.UnionType):
        return hint, False, ()
    words = tuple(w for a in args if typing.get_origin(a) is typing.Literal for w in typing.get_args(a))
    main = next(a for a in args if a is not type(None) and typing.get_origin(a) is not typing.Literal)
    return main, type(None) in args, words


def section_type(hint: Any) -> type[Section] | None:
    """The Section class a field holds (possibly optional), or None."""
    main, _, _ = _parts(hint)
    return main if isinstance(main, type) and issubclass(main, Section) else None


def enum_type(hint: Any) -> type[enum.Enum] | None:
    main, _, _ = _parts(hint)
    return main if isinstance(main, type) and issubclass(main, enum.Enum) else None


def coerce(hint: Any, value: Any, path: str) -> Any:
    """`value` as the declared type: numbers and booleans from strings, lists as tuples, enum
    values as members, mappings as sections; or ConfigError naming the field."""
    main, optional, words = _parts(hint)
    if value is None and optional:
        return None
    if isinstance(value, str) and value in words:  # a word such as "auto" beside a number
        return value
    if isinstance(main, type) and issubclass(main, enum.Enum):
        return as_enum(main, value, path)
    if isinstance(main, type) and issubclass(main, Section):
        if isinstance(value, main):
            return value
        check(isinstance(value, dict), f"{path} must be a mapping, got {value!r}")
        return main.from_dict(value, path)
    origin, args = typing.get_origin(main), typing.get_args(main)
    bad = ConfigError(f"{path} must be {getattr(main, '__name__', main)}, got {value!r}")
    if main is float:
        if isinstance(value, bool):
            raise bad
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad from None
    if main is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise bad
        try:
            return int(value)
        except (TypeError, ValueError):
            raise bad from None
    if main is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise bad
        return value
    if origin is tuple and args and args[-1] is Ellipsis:
        if not isinstance(value, (list, tuple)):
            raise bad
        return tuple(coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    return value


def _rule(bounds: dict[str, Any]) -> str:
    if "ge" in bounds and "le" in bounds:
        return f"in [{bounds['ge']}, {bounds['le']}]"
    low = "[" if "ge" in bounds else "("
    high = "]" if "le" in bounds else ")"
    if ("ge" in bounds or "gt" in bounds) and ("le" in bounds or "lt" in bounds):
        lo = bounds.get("ge", bounds.get("gt"))
        hi = bounds.get("le", bounds.get("lt"))
        return f"in {low}{lo}, {hi}{high}"
    return " and ".join(f"{_RULES[k]} {v}" for k, v in bounds.items() if k in _RULES)


def within(value: Any, bounds: dict[str, Any]) -> bool:
    if "min_length" in bounds and len(value) < bounds["min_length"]:
        return False
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return True
    return all(
        {"ge": value >= b, "gt": value > b, "le": value <= b, "lt": value < b}[k]
        for k, b in bounds.items()
        if k in _RULES
    )


class Section:
    """A frozen, keyword-only dataclass of fields declared with `field`, read from a mapping.
    `path` is where the section sits in the run config; messages name fields under it."""

    section_path: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            where = f"{self.section_path}.{f.name}".lstrip(".")
            value = coerce(hints[f.name], getattr(self, f.name), where)
            object.__setattr__(self, f.name, value)
            bounds = bounds_of(f)
            # null, and a word such as "auto" beside a number, are checked by their type alone
            if bounds and value is not None and (not isinstance(value, str) or "min_length" in bounds):
                null = " or null" if _parts(hints[f.name])[1] else ""
                what = f"at least {bounds['min_length']} long" if "min_length" in bounds else _rule(bounds)
                about = f" ({doc_of(f)})" if doc_of(f) else ""
                check(within(value, bounds), f"{where} must be {what}{null}, got {value!r}{about}")
        self.validate()

    def validate(self) -> None:
        """Rules that relate several fields (bounds of one field are checked from its declaration)."""

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, enum.Enum):
                v = v.value
            elif isinstance(v, Section):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = [x.to_dict() if isinstance(x, Section) else x for x in v]
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str | None = None):
        path = cls.section_path if path is None else path
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        check(not unknown, f"{path or cls.__name__}: unknown field(s) {unknown}; known: {sorted(names)}")
        if path == cls.section_path:
            return cls(**data)
        try:  # a section used at another place (train.mesh.rollout is a train.mesh shape): name that place
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(
                str(exc).replace(cls.section_path, path) if cls.section_path else f"{path}: {exc}"
            ) from None

    @classmethod
    def describe(cls) -> list[tuple[str, Any, dataclasses.Field]]:
        """(name, type hint, field) of each field, in declaration order: what forms and docs show."""
        hints = typing.get_type_hints(cls)
        return [(f.name, hints[f.name], f) for f in dataclasses.fields(cls)]


def section(cls=None, *, path: str = ""):
    """Declare a Section: a frozen keyword-only dataclass at `path` in the run config."""

    def wrap(c):
        c.section_path = path
        return dataclasses.dataclass(frozen=True, kw_only=True)(c)

    return wrap if cls is None else wrap(cls)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict, returning a copy."""
    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        check(bool(sep) and bool(key), f"override {item!r} must look like key.path=value")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            check(isinstance(node, dict), f"override {item!r}: {part!r} is not a section")
        node[parts[-1]] = value
    return out
