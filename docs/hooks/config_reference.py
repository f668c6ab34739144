"""The config reference page (reference/config.md), generated when the site is built from the typed
config's own field declarations, so it cannot drift from the code: every Section of
grpo_core/config (each field's type hint, its `field(default, doc=..., ge=...)`), walked from
the run config's sections down, and the defaults the two recipes give (grpo_core.config.recipes:
the synthetic demo's, and TRL's/verl's on the user's data).

mkdocs runs it as a hook (mkdocs.yml `hooks:`): the page is added to the site's files in memory,
nothing is written into docs/. `python docs/hooks/config_reference.py [FILE]` writes the same
Markdown to FILE (or prints it). tests/test_docs.py checks that every declared field is on the
built page.
"""

from __future__ import annotations

import dataclasses
import enum
import html
import sys
import typing
from typing import Any, Iterator

from grpo_core.config.data import DataConfig
from grpo_core.config.fields import (
    MISSING,
    Section,
    Trust,
    _parts,  # the same reading of a hint as validation's (None, and words like 'auto')
    api_max_of,
    bounds_of,
    doc_of,
    enum_type,
    section_type,
    trust_of,
)
from grpo_core.config.model import ModelConfig, ModelSection
from grpo_core.config.presets import PRESETS
from grpo_core.config.run import RUN_DOCS, EvalConfig, PipelineConfig, RewardSpec, RunConfig
from grpo_core.config.train import TrainConfig
from grpo_core.config.work import TOTALS

PAGE = "reference/config.md"
# The run config's sections, in the order of a config file (RunConfig.SECTIONS).
SECTIONS: list[tuple[str, type[Section]]] = [
    ("model", ModelSection),
    ("data", DataConfig),
    ("rewards[]", RewardSpec),
    ("train", TrainConfig),
    ("eval", EvalConfig),
    ("pipeline", PipelineConfig),
]
_SYMBOLS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥"}


@dataclasses.dataclass(frozen=True)
class Row:
    path: str  # train.grpo.num_generations
    kind: str  # the type, as a user writes the value
    default: str
    allowed: str
    doc: str


def _type_name(hint: Any) -> str:
    main, optional, words = _parts(hint)
    if enum_type(hint) is not None:
        name = "choice"
    elif section_type(hint) is not None:
        name = "section"
    elif typing.get_origin(main) is tuple:
        args = typing.get_args(main)
        name = f"list of {args[0].__name__}" if args else "list"
    elif main is tuple:
        name = "list"
    elif main is dict or typing.get_origin(main) is dict:
        name = "mapping"
    else:
        name = getattr(main, "__name__", str(main))
    return " or ".join([name, *(f'"{w}"' for w in words), *(["null"] if optional else [])])


def _shown(value: Any) -> str:
    """A value as a user writes it in YAML (or `--set`)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, Section):
        value = value.to_dict()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        import yaml  # heavy: only for the few list and mapping defaults

        return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return str(value)


def _declared(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _at(config: dict[str, Any], path: str) -> Any:
    """The value at `path` in a config mapping (MISSING where it is not there)."""
    node: Any = config
    for part in path.replace("[]", "").split("."):
        if isinstance(node, list):
            node = node[0] if node else MISSING
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


UNDECLARED = object()  # a run-level field: no declaration, only what the recipes fill in


def _default(declared: Any, path: str, recipes: dict[str, dict[str, Any]]) -> str:
    """The declared default, and what the recipes make of it where that differs (recipes that
    agree share one entry)."""
    shown = {name: _shown(v) for name, cfg in recipes.items() if (v := _at(cfg, path)) is not MISSING}
    if declared is UNDECLARED:
        parts = []
    else:
        parts = ["required" if declared is MISSING else f"`{_shown(declared)}`"]
        shown = {name: v for name, v in shown.items() if declared is MISSING or v != _shown(declared)}
    by_value: dict[str, list[str]] = {}
    for name, v in shown.items():
        by_value.setdefault(v, []).append(name)
    if declared is UNDECLARED and len(by_value) == 1:
        return f"`{next(iter(by_value))}`"
    parts += [f"{', '.join(names)}: `{v}`" for v, names in by_value.items()]
    return "; ".join(parts)


def _allowed(hint: Any, f: dataclasses.Field | None) -> str:
    out = []
    choices = enum_type(hint)
    if choices is not None:
        out.append(", ".join(f"`{m.value}`" for m in choices))
    bounds = bounds_of(f) if f is not None else {}
    out += [f"{_SYMBOLS[k]} {v}" for k, v in bounds.items()]
    if f is not None and api_max_of(f) is not None:  # the trust policy's limit on work (trust.md)
        out.append(f"from the API ≤ {api_max_of(f):,}")
    if f is not None and trust_of(f) not in (None, Trust.SAFE):  # what the value names (trust.md)
        out.append(f"[{trust_of(f).value}](../trust.md)")
    return "; ".join(out)


def _text(doc: str) -> str:
    """A description in a table cell: HTML and Markdown's own characters shown as they are."""
    doc = html.escape(doc.strip(), quote=False).replace("{", "&#123;").replace("}", "&#125;")
    for ch in "\\`*_[]|":
        doc = doc.replace(ch, "\\" + ch)
    return doc if not doc or doc.endswith((".", "?", "!")) else doc + "."


def walk(cls: type[Section], path: str, recipes: dict[str, dict[str, Any]]) -> Iterator[tuple[str, list[Row]]]:
    """(section path, its rows) for `cls` at `path` and each section below it, depth first."""
    rows, below = [], []
    for name, hint, f in cls.describe():
        where = f"{path}.{name}"
        sub = section_type(hint)
        if cls is ModelSection and name == "overrides":
            continue  # the architecture's fields, a section of their own below
        doc = doc_of(f)
        if sub is not None:
            doc = doc or f"The {where} section (below)"
            optional = _parts(hint)[1]
            kind, default = ("section or null", "`null` (off)") if optional else ("section", "its fields' (below)")
            rows.append(Row(where, kind, default, "", doc))
            below.append((sub, where))
            continue
        rows.append(Row(where, _type_name(hint), _default(_declared(f), where, recipes), _allowed(hint, f), doc))
    if cls is ModelSection:
        rows = [r if r.path != "model.preset" else dataclasses.replace(r, allowed=_presets()) for r in rows]
    yield path, rows
    for sub, where in below:
        yield from walk(sub, where, recipes)


def _presets() -> str:
    return ", ".join(f"`{name}`" for name in PRESETS)


def _architecture(recipes: dict[str, dict[str, Any]]) -> list[Row]:
    """The ModelConfig fields a `model:` mapping may set beside its own keys (model.overrides)."""
    rows = []
    for name, hint, f in ModelConfig.describe():
        declared = _declared(f)
        default = "the preset's or the checkpoint's" if declared is MISSING else f"`{_shown(declared)}`"
        rows.append(Row(f"model.{name}", _type_name(hint), default, _allowed(hint, f), doc_of(f)))
    return rows


def recipes() -> dict[str, dict[str, Any]]:
    """The config each recipe resolves an empty config to: the synthetic demo's, and on the user's
    data (a data.source set: TRL's and verl's defaults)."""
    return {
        "synthetic demo": RunConfig.from_dict({}).to_dict(),
        "your data": RunConfig.from_dict({"data": {"source": "prompts.jsonl"}}).to_dict(),
    }


def _table(rows: list[Row]) -> list[str]:
    out = ["| field | type | default | allowed | description |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        anchor = f'<a id="{r.path}"></a>'
        out.append(f"| {anchor}`{r.path}` | {r.kind} | {r.default} | {r.allowed} | {_text(r.doc)} |")
    return out


INTRO = """\
# Config reference

Every field of a run config: its name, type, default, allowed values and description, generated
when this site is built from the field declarations in `grpo_core/config/` (each field is
declared once, with its default, description and bounds; validation, the Prefect UI's run form
and this page all read that declaration). A config is YAML (`grpo run --config FILE`), `--set
key=value` overrides (the value parsed as YAML), or a deployment's parameters; see
[Configuration](../configuration.md) for how they combine.

The default column gives the declared default, then, where it differs, what each recipe fills
in for a field the config leaves out ([Defaults by task](../configuration.md#defaults-by-task)):
*synthetic demo* is the embedded default (`grpo demo`), *your data* a run whose `data.source`,
`model.path` or real model preset is set (TRL's and verl's defaults). A field the config sets is
always kept. Empty (`null`) means "the default for this config" unless the description says
otherwise.
"""


def render() -> str:
    given = recipes()
    lines = [INTRO]
    top = [
        Row(
            "run_name", "str or null", _default(UNDECLARED, "run_name", given), "one folder name", RUN_DOCS["run_name"]
        ),
        Row("storage.root", "str", _default(UNDECLARED, "storage.root", given), "length ≥ 1", RUN_DOCS["storage.root"]),
        Row("rewards", "list of rewards[]", _default(UNDECLARED, "rewards", given), "length ≥ 1", RUN_DOCS["rewards"]),
    ]
    lines += ["## The run {#top}", "", *_table(top), ""]
    lines += [
        "## Work totals {#work-totals}",
        "",
        "Products of the fields above that a run started from a deployment may not exceed as a whole (each "
        "factor has its own limit too); an operator raises one with `grpo serve --raise-limit NAME=N` "
        "([the trust model](../trust.md)). A config you run yourself is not bounded by them.",
        "",
        "| total | computed as | from the API | description |",
        "| --- | --- | --- | --- |",
        *(f'| <a id="{t.name}"></a>`{t.name}` | {t.formula()} | ≤ {t.api_max:,} | {_text(t.doc)} |' for t in TOTALS),
        "",
    ]
    for name, cls in SECTIONS:
        # a reward's fields have no recipe default of their own (the recipes' reward lists are `rewards`')
        for path, rows in walk(cls, name, {} if cls is RewardSpec else given):
            lines += [f"## `{path}` {{#{path.replace('[]', '')}}}", "", *_table(rows), ""]
            if path == "model":
                lines += [
                    "## Model architecture {#model.architecture}",
                    "",
                    "Beside its own keys a `model:` mapping may set the architecture's fields (Hugging Face's "
                    "names), over the preset's; with `model.path` only `dtype` and `param_dtype`, the rest "
                    "coming from the checkpoint's `config.json`.",
                    "",
                    *_table(_architecture(given)),
                    "",
                ]
    return "\n".join(lines)


def on_files(files, config):
    """mkdocs hook: the generated page joins the site's files (nothing is written into docs/)."""
    from mkdocs.structure.files import File  # heavy: mkdocs, only when the site is built

    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    text = render()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
