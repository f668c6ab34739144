"""The pipeline's parameters as typed models: what Prefect shows as the run form in the UI and
checks before a run starts (types, bounds, choices), built from the config sections of
grpo_core.config, whose field declarations hold each type, default, description and bound
once. Cross-field rules (e.g. prompts_per_step divisible by the micro-batches) are checked by
RunConfig when the run starts, with messages that name the field.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import types
import typing
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model, model_serializer, model_validator
from pydantic.fields import FieldInfo

from grpo_core.config.fields import bounds_of, doc_of, enum_type, section_type
from grpo_core.config.model import LoraConfig, ModelSection, ReferencePolicy
from grpo_core.config.presets import PRESETS
from grpo_core.config.run import RUN_DOCS, EvalConfig, PipelineConfig, RewardSpec, RunConfig
from grpo_core.config.train import TrainConfig
from grpo_core.data.prepare import DataConfig

_DEFAULTS = RunConfig.from_dict({}).to_dict()
# A config on the user's data: the 'hf' recipe's defaults (grpo_core.config.recipes), what an
# empty field means there.
_ON_USER_DATA = RunConfig.from_dict({"data": {"source": "prompts.jsonl"}}).to_dict()


_REWARD = {name: f for name, _, f in RewardSpec.describe()}


def _plain(schema: dict[str, Any]) -> None:
    """An empty-means-default field as the form shows it: an input of its own type, empty until
    filled (no null default to pre-fill, no "int | None" switch)."""
    if "default" in schema and schema["default"] is None:
        del schema["default"]
    kinds = [k for k in schema.get("anyOf", ()) if k.get("type") != "null"]
    if "anyOf" in schema and len(kinds) < len(schema["anyOf"]):
        del schema["anyOf"]
        if len(kinds) == 1:
            schema.update(kinds[0])
        else:
            schema["anyOf"] = kinds


def _positions(schema: dict[str, Any], cls: type) -> None:
    """Each field's place in its section as Prefect's form reads it (`position`: the UI sorts a
    section's fields by it, a field without one first), in declaration order: what a run needs
    first, the advanced subsections last."""
    for i, prop in enumerate(schema.get("properties", {}).values()):
        prop["position"] = i


def _positions_without(names: tuple[str, ...]):
    """_positions for a section whose fields `names` the form shows at its top (_TOP): each leaves
    the section's form but not its schema. It moves to `patternProperties`, which the server
    still checks an API call or a deployment's YAML against and which neither UI renders."""

    def extra(schema: dict[str, Any], cls: type) -> None:
        props = schema.get("properties", {})
        for name in names:
            prop = props.pop(name)  # null: the default, as the top field reads it
            kinds = [{k: v for k, v in prop.items() if k not in ("description", "title")}, {"type": "null"}]
            schema.setdefault("patternProperties", {})[f"^{name}$"] = {"anyOf": kinds}
        _positions(schema, cls)

    return extra


class _Form(BaseModel):
    """A section of the form: empty fields are left out when it is written out (the flow's
    default parameters, a flow run's parameters), so they stay empty in the UI."""

    model_config = ConfigDict(json_schema_extra=_positions)

    @model_serializer(mode="wrap")
    def _drop_empty(self, handler):
        data, fields = handler(self), type(self).model_fields
        return {
            k: v for k, v in data.items() if not (v is None and k in fields and fields[k].json_schema_extra is _plain)
        }


def _empty(**kw: Any) -> Any:
    """A field that is empty unless filled: the default for this config."""
    return Field(None, json_schema_extra=_plain, **kw)


class _Switched(_Form):
    """An optional section (LoRA, another mesh for the rollout): a plain switch, `enabled`, and
    its fields, instead of a null/object choice (which the UI shows as 'Property is type
    "None"'). Off: the section is left out of the config (null, as `lora: null` in a YAML file).
    Given as null or false it is off; given as a mapping without `enabled` (a YAML file's, the
    API's; `{}` or true: the section's defaults) it is on."""

    @model_validator(mode="before")
    @classmethod
    def _switch(cls, value: Any) -> Any:
        if value is None or value is False:
            return {"enabled": False}
        if value is True:
            return {"enabled": True}
        if isinstance(value, dict) and "enabled" not in value:
            return {**value, "enabled": True}
        return value


def _switched(model: type[BaseModel], title: str | None, doc: str) -> tuple[Any, Any]:
    """The field of an optional section `model`: `enabled` first (off), then its fields."""
    name = model.__name__
    off = re.search(r"[Ee]mpty: (.*)$", doc)
    said = f"Off (the default): {off.group(1).rstrip('. ')}." if off else "Off (the default): left out."
    switch = (bool, Field(False, title="Enabled", description=f"On: the fields below apply. {said}"))
    fields = {"enabled": switch, **{k: (f.annotation, f) for k, f in model.model_fields.items()}}
    base = type(name, (_Switched,), {"model_config": ConfigDict(extra="forbid", title=model.model_config.get("title"))})
    switched = create_model(name, __base__=base, **fields)
    return switched, Field(default_factory=lambda: switched(enabled=False), title=title, description=doc)


def _annotation(hint: Any, enum_cls: type[enum.Enum] | None, bounds: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The pydantic type of a config field, and the bounds left for its Field (a number beside a
    word such as "auto" carries its own bounds)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    if enum_cls is not None:
        ann = Literal[tuple(m.value for m in enum_cls)]
        return (Optional[ann] if optional else ann), bounds
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        words = [a for a in inner if typing.get_origin(a) is Literal]
        if words:
            number = typing.Annotated[inner[0], Field(**bounds)]
            return typing.Union[(number, *words)], {}
        return Optional[_annotation(inner[0], None, {})[0]], bounds
    if origin is tuple:
        return list[args[0]], bounds
    if hint is dict or origin is dict:
        return dict[str, Any], bounds
    return hint, bounds


# The fields a user changes, first in their section; the rest keep their declaration order.
_FIRST = {
    "model": ("path", "preset"),
    "data": ("source", "format", "eval_source"),
}
# The fields the form leads with, above every section, though the config keeps each in its
# section (field: section): a parameter's shape cannot change (API calls, deployments' YAML and
# `--set` write config.train.num_steps), so the section still takes the field, and RunParams
# moves it up (RunParams._lift) and back (RunParams.to_config).
_TOP = {"num_steps": "train", "epochs": "pipeline"}
# Section titles as the form shows them.
_TITLES = {
    "storage": "Storage",
    "model": "Model",
    "model.lora": "Model: LoRA adapters",
    "data": "Data",
    "train": "Training",
    "train.grpo": "Training (advanced): the GRPO objective",
    "train.sampling": "Training (advanced): sampling of completions",
    "train.optimizer": "Training (advanced): optimizer",
    "train.rollout": "Training (advanced): rollout engine",
    "train.mesh": "Training (advanced): device mesh",
    "pipeline": "Pipeline stages",
    "pipeline.launcher": "Pipeline stages (advanced): where workers run",
    "pipeline.readiness": "Pipeline stages (advanced): the TPU to check before renting it",
    "eval": "Evaluation",
}
_SYMBOLS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥"}
_EMPTY = "Empty: the default for this config"


def _shown(v: Any) -> str:
    v = v.value if isinstance(v, enum.Enum) else list(v) if isinstance(v, tuple) else v
    return json.dumps(v) if isinstance(v, (str, list, dict, bool)) or v is None else str(v)


def _describe(doc: str, bounds: dict[str, Any], default: Any, demo: Any, fill: bool) -> str:
    """A field's description as the form shows it: what it does, its bounds, and what an empty
    field means (the default for this config, as on the command line)."""
    text = doc.rstrip(". ") + "." if doc else ""
    if bounds:
        text += " Allowed: " + ", ".join(f"{_SYMBOLS[k]} {v}" for k, v in bounds.items()) + "."
    if fill:  # empty means something else here (e.g. no clipping): the default is filled in
        return f"{text} Default: {_shown(default)}.".strip()
    if default is None:
        said = "empty" in text.lower() or "null" in text.lower()
        return (text if said else f"{text} {_EMPTY}.").strip()
    if demo is None or _shown(default) == _shown(demo):
        return f"{text} {_EMPTY} ({_shown(default)}).".strip()
    return f"{text} {_EMPTY} ({_shown(default)}; on the built-in synthetic task: {_shown(demo)}).".strip()


class RewardParams(BaseModel):
    model_config = ConfigDict(extra="forbid", title="Reward", json_schema_extra=_positions)
    function: str | None = _empty(
        description=_describe(doc_of(_REWARD["function"]), {}, None, None, False), **bounds_of(_REWARD["function"])
    )
    model: str | None = _empty(
        description=_describe(doc_of(_REWARD["model"]), {}, None, None, False), **bounds_of(_REWARD["model"])
    )
    weight: float = Field(1.0, description=doc_of(_REWARD["weight"]))
    params: dict[str, Any] | None = _empty(description=doc_of(_REWARD["params"]))
    batch_size: int | None = _empty(
        description=_describe(doc_of(_REWARD["batch_size"]), bounds_of(_REWARD["batch_size"]), None, None, False),
        **bounds_of(_REWARD["batch_size"]),
    )
    max_length: int | None = _empty(
        description=_describe(doc_of(_REWARD["max_length"]), bounds_of(_REWARD["max_length"]), None, None, False),
        **bounds_of(_REWARD["max_length"]),
    )
    clip: list[float] | None = _empty(description=doc_of(_REWARD["clip"]), min_length=2, max_length=2)


def _ordered(described: list[tuple[str, Any, Any]], path: str) -> list[tuple[str, Any, Any]]:
    """A section's fields as the form shows them: those a user changes first, then the rest,
    then its subsections (the advanced ones: Training's objective, sampling, optimizer, ...)."""
    first = _FIRST.get(path, ())
    return sorted(
        described,
        key=lambda d: (section_type(d[1]) is not None, first.index(d[0]) if d[0] in first else len(first)),
    )


def _section_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _model_for(
    cls, path: str, demo: dict[str, Any], name: str | None = None, varies: bool = True, user: dict | None = None
) -> type[BaseModel]:
    """A pydantic model mirroring section `cls`: same names and types, descriptions and bounds
    from each field's declaration. Every field is optional and empty unless filled: an empty
    field means the default for this config, exactly as a key left out on the command line.
    `demo` holds the embedded default's values; `varies`: whether a section's own defaults
    replace them when the user brings their own data, model or rewards (else `demo` is the
    default of every config). `user`: the values on the user's data (the 'hf' recipe), shown as
    the default where they differ from the section's own."""
    fields: dict[str, Any] = {}
    for fname, hint, f in _ordered(cls.describe(), path):
        doc, default = doc_of(f), _section_default(f)
        if not varies and (demo or {}).get(fname) is not None:
            default = demo[fname]
        sub = section_type(hint)
        if sub is None and (user or {}).get(fname) is not None:
            default = user[fname]
        if sub is not None:
            sub_user = (user or {}).get(fname) if isinstance((user or {}).get(fname), dict) else None
            model = _model_for(sub, f"{path}.{fname}", (demo or {}).get(fname) or {}, varies=varies, user=sub_user)
            title = _TITLES.get(f"{path}.{fname}")
            doc = doc or title
            if default is None:  # an optional section: off (null) unless given, an enable switch in the form
                fields[fname] = _switched(model, title, doc)
            else:
                fields[fname] = (model, Field(default_factory=model, title=title, description=doc))
            continue
        # Shown with their default instead of empty (a default that is the same for every
        # config): a field whose empty value means something (max_grad_norm: empty = no
        # clipping), and a switch, which the form submits as false when untouched.
        nullable = type(None) in typing.get_args(hint)
        # a switch whose default depends on the recipe (dynamic_sampling: on for the demo): true,
        # false or empty (the recipe's), so an untouched form keeps the recipe's value
        by_recipe = hint is bool and (demo or {}).get(fname) not in (None, default)
        fill = default is not None and (nullable or hint is bool) and not by_recipe
        ann, bounds = _annotation(hint, enum_type(hint), bounds_of(f))
        description = _describe(doc, bounds_of(f), default, (demo or {}).get(fname), fill)
        if fill:
            fields[fname] = (ann, Field(default=default, description=description, **bounds))
        elif by_recipe or (nullable and bool in typing.get_args(hint)):  # true, false or empty: a three-way switch
            fields[fname] = (Optional[ann], Field(default=None, description=description))
        else:
            fields[fname] = (Optional[ann], _empty(description=description, **bounds))
    cls_name = name or "".join(p.capitalize() for p in path.replace("_", ".").split(".")) + "Params"
    config = ConfigDict(extra="forbid", title=_TITLES.get(path, path))
    top = tuple(f for f, section in _TOP.items() if section == path)
    if top:
        config["json_schema_extra"] = _positions_without(top)
    base = type(cls_name, (_Form,), {"model_config": config})
    return create_model(cls_name, __base__=base, **fields)


class StorageParams(_Form):
    model_config = ConfigDict(extra="forbid", title=_TITLES["storage"])
    root: Optional[str] = _empty(
        description=f"{RUN_DOCS['storage.root']}. {_EMPTY} ({_shown(_DEFAULTS['storage']['root'])}, "
        "relative to the folder the flow runs in).",
        min_length=1,
    )


_MODEL = {name: f for name, _, f in ModelSection.describe()}
LoraParams = _model_for(LoraConfig, "model.lora", LoraConfig().to_dict(), name="LoraParams")
_LoraSwitched, _LoraField = _switched(LoraParams, _TITLES["model.lora"], doc_of(_MODEL["lora"]))


def _model_field(name: str, **kw: Any) -> Any:
    f, demo = _MODEL[name], _DEFAULTS["model"].get(name)
    # a field empty in the section whose empty still has a value (preset: tiny) says that value
    default = _section_default(f) if _section_default(f) is not None else demo
    description = _describe(doc_of(f), bounds_of(f), default, demo, False)
    return _empty(description=description, **bounds_of(f), **kw)


class ModelParams(_Form):
    # Other keys override the preset's fields (Hugging Face names: hidden_size, dtype, ...).
    model_config = ConfigDict(extra="allow", title=_TITLES["model"])
    path: Optional[str] = _model_field("path")
    preset: Optional[Literal[tuple(PRESETS)]] = _model_field("preset")
    revision: Optional[str] = _model_field("revision")
    tokenizer: Optional[str] = _model_field("tokenizer")
    seed: Optional[int] = _model_field("seed")
    init_from: Optional[str] = _model_field("init_from", title="Start from run (init_from)")
    reference: Optional[Literal[tuple(r.value for r in ReferencePolicy)]] = _model_field(
        "reference", title="KL reference (with init_from)"
    )
    lora: _LoraSwitched = _LoraField  # a subsection: last


# (the source of _ON_USER_DATA is a stand-in: an empty source is the synthetic task on every config)
DataParams = _model_for(DataConfig, "data", _DEFAULTS["data"], user={**_ON_USER_DATA["data"], "source": None})
# Training's defaults follow the recipe (grpo_core.config.recipes): the demo's on the synthetic
# task, TRL's and verl's on the user's data or a real model; the stages' are the same for all.
TrainParams = _model_for(TrainConfig, "train", _DEFAULTS["train"], user=_ON_USER_DATA["train"])
EvalParams = _model_for(EvalConfig, "eval", _DEFAULTS["eval"])
PipelineParams = _model_for(PipelineConfig, "pipeline", _DEFAULTS["pipeline"], varies=False)


def _given(m: BaseModel) -> dict[str, Any]:
    """The fields of `m` that were given and not left empty, as a config mapping. An empty field
    (None where the form's default is None) means "the default for this config", as a key left
    out of a YAML file or the command line does; RunConfig then derives it from what was given
    (prompt length from the data, evaluation rewards from the rewards, ...)."""
    out: dict[str, Any] = {}
    for name in m.model_fields_set:
        v, f = getattr(m, name), type(m).model_fields.get(name)
        if v is None and (f is None or f.default is None):
            continue
        if isinstance(v, _Switched):
            if not v.enabled:
                continue  # off: left out, as null is
            v = {k: x for k, x in _given(v).items() if k != "enabled"}
        elif isinstance(v, BaseModel):
            v = _given(v)
        elif isinstance(v, list):
            v = [_given(x) if isinstance(x, BaseModel) else x for x in v]
        out[name] = v
    return out


def _top(section: type[BaseModel], name: str) -> Any:
    """The form's top field for `name` of `section`: its type, bounds and description, naming
    where a config file keeps it."""
    f, path = section.model_fields[name], f"{_TOP[name]}.{name}"
    return FieldInfo.merge_field_infos(f, description=f"{f.description} In a config file, the API or --set: {path}.")


_Steps = TrainParams.model_fields["num_steps"].annotation
_Epochs = PipelineParams.model_fields["epochs"].annotation


class RunParams(_Form):
    """A GRPO run: where it lives, the model, the data, the rewards, training, the pipeline's
    stages and evaluation. A field left empty takes the default for this config, as on the
    command line (the embedded default is the tiny preset on the synthetic task)."""

    model_config = ConfigDict(extra="forbid", title="GRPO run")
    # What a run needs first: how long (steps and epochs, which a config keeps in Training and
    # Pipeline, see _TOP), the data, the model, the rewards; then the long sections, each with
    # its own fields before its advanced subsections, and where the run lands at the end.
    # Prefect's form follows this order (each field's `position`).
    num_steps: _Steps = _top(TrainParams, "num_steps")
    epochs: _Epochs = _top(PipelineParams, "epochs")
    data: DataParams = Field(
        title=_TITLES["data"], default_factory=DataParams, description="The prompts: source, format, split, length"
    )
    model: ModelParams = Field(title=_TITLES["model"], default_factory=ModelParams, description="The starting policy")
    rewards: Optional[list[RewardParams]] = _empty(
        description=RUN_DOCS["rewards"]
        + f". {_EMPTY} (char_match on the built-in synthetic task; math_answer on data with a reference answer)",
        min_length=1,
    )
    train: TrainParams = Field(
        title=_TITLES["train"],
        default_factory=TrainParams,
        description="The objective, sampling, optimizer, rollout engine and mesh (advanced)",
    )
    pipeline: PipelineParams = Field(
        title=_TITLES["pipeline"],
        default_factory=PipelineParams,
        description="Checkpoints, retries and time limits of the stages",
    )
    eval: EvalParams = Field(
        title=_TITLES["eval"], default_factory=EvalParams, description="Evaluation on the eval split after each epoch"
    )
    storage: StorageParams = Field(
        title=_TITLES["storage"], default_factory=StorageParams, description="Where the run folder lives"
    )
    run_name: Optional[str] = _empty(title="Run folder", description=RUN_DOCS["run_name"])

    @model_validator(mode="before")
    @classmethod
    def _lift(cls, value: Any) -> Any:
        """train.num_steps and pipeline.epochs where a config, an API call or a deployment's YAML
        writes them become the top fields. A top field given (not empty) wins: a deployment whose
        parameters spell the section's keeps that value out of sight in the form, which submits
        it beside the top field the user typed."""
        if not isinstance(value, dict):
            return value
        out = dict(value)
        for name, section in _TOP.items():
            inner = out.get(section)
            if isinstance(inner, dict) and name in inner:
                inner = dict(inner)
                given = inner.pop(name)
                if out.get(name) is None:
                    out[name] = given
                if inner:
                    out[section] = inner
                else:
                    del out[section]
        return out

    def to_config(self) -> RunConfig:
        # The fields that were given and not left empty: RunConfig applies the defaults that
        # depend on them, as for a YAML file or --set overrides.
        given = _given(self)
        for name, section in _TOP.items():
            if name in given:
                given[section] = {**given.get(section, {}), name: given.pop(name)}
        return RunConfig.from_dict(given)
