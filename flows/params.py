"""The pipeline's parameters as typed models: what Prefect shows as the run form in the UI and
checks before a run starts (types, bounds, choices), built from the config sections of
grpo_core.config, whose field declarations hold each type, default, description and bound
once. Cross-field rules (e.g. prompts_per_step divisible by the micro-batches) are checked by
RunConfig when the run starts, with messages that name the field.
"""

from __future__ import annotations

import enum
import types
import typing
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model

from grpo_core.config.fields import bounds_of, doc_of, enum_type, section_type
from grpo_core.config.model import LoraConfig, ModelSection
from grpo_core.config.presets import PRESETS
from grpo_core.config.run import RUN_DOCS, EvalConfig, PipelineConfig, RewardSpec, RunConfig
from grpo_core.config.train import TrainConfig
from grpo_core.data.prepare import DataConfig

_DEFAULTS = RunConfig.from_dict({}).to_dict()


_REWARD = {name: f for name, _, f in RewardSpec.describe()}


class RewardParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    function: str = Field(description=doc_of(_REWARD["function"]), **bounds_of(_REWARD["function"]))
    weight: float = Field(1.0, description=doc_of(_REWARD["weight"]))
    params: dict[str, Any] | None = Field(None, description=doc_of(_REWARD["params"]))


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


def _title(path: str) -> str:
    return "".join(p.capitalize() for p in path.replace("_", ".").split(".")) + "Params"


def _model_for(cls, path: str, defaults: dict[str, Any], title: str | None = None) -> type[BaseModel]:
    """A pydantic model mirroring section `cls`: same names, types and defaults (the resolved run
    defaults), descriptions and bounds from each field's declaration."""
    fields: dict[str, Any] = {}
    for name, hint, f in cls.describe():
        doc, bounds = doc_of(f) or None, bounds_of(f)
        sub = section_type(hint)
        if sub is not None and defaults.get(name) is not None:
            model = _model_for(sub, f"{path}.{name}", defaults[name])
            fields[name] = (model, Field(default_factory=model, description=doc))
        elif name == "rewards":
            fields[name] = (list[RewardParams], Field(default=defaults[name], description=doc, validate_default=True))
        else:
            ann, bounds = _annotation(hint, enum_type(hint), bounds)
            fields[name] = (ann, Field(default=defaults[name], description=doc, **bounds))
    return create_model(title or _title(path), __config__=ConfigDict(extra="forbid"), **fields)


class StorageParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    root: str = Field(_DEFAULTS["storage"]["root"], description=RUN_DOCS["storage.root"], min_length=1)


LoraParams = _model_for(LoraConfig, "model.lora", LoraConfig().to_dict(), title="LoraParams")
_MODEL = {name: f for name, _, f in ModelSection.describe()}


class ModelParams(BaseModel):
    # Other keys override the preset's fields (Hugging Face names: hidden_size, dtype, ...).
    model_config = ConfigDict(extra="allow")
    path: Optional[str] = Field(None, description=doc_of(_MODEL["path"]))
    revision: Optional[str] = Field(None, description=doc_of(_MODEL["revision"]))
    preset: Literal[tuple(PRESETS)] = Field(_DEFAULTS["model"]["preset"], description=doc_of(_MODEL["preset"]))
    seed: int = Field(_DEFAULTS["model"]["seed"], description=doc_of(_MODEL["seed"]), **bounds_of(_MODEL["seed"]))
    tokenizer: Optional[str] = Field(None, description=doc_of(_MODEL["tokenizer"]))
    lora: Optional[LoraParams] = Field(None, description=doc_of(_MODEL["lora"]))


DataParams = _model_for(DataConfig, "data", _DEFAULTS["data"])
TrainParams = _model_for(TrainConfig, "train", _DEFAULTS["train"])
EvalParams = _model_for(EvalConfig, "eval", _DEFAULTS["eval"])
PipelineParams = _model_for(PipelineConfig, "pipeline", _DEFAULTS["pipeline"])


class RunParams(BaseModel):
    """A GRPO run: where it lives, the model, the data, the rewards, training, evaluation and how
    the stages run. Every field has the embedded default (the tiny preset on the synthetic task)."""

    model_config = ConfigDict(extra="forbid")
    run_name: Optional[str] = Field(None, description=RUN_DOCS["run_name"])
    storage: StorageParams = Field(default_factory=StorageParams)
    model: ModelParams = Field(default_factory=ModelParams)
    data: DataParams = Field(default_factory=DataParams)
    rewards: list[RewardParams] = Field(
        default=_DEFAULTS["rewards"], description=RUN_DOCS["rewards"], min_length=1, validate_default=True
    )
    train: TrainParams = Field(default_factory=TrainParams)
    eval: EvalParams = Field(default_factory=EvalParams)
    pipeline: PipelineParams = Field(default_factory=PipelineParams)

    def to_config(self) -> RunConfig:
        # Only the fields that were given: RunConfig applies the defaults that depend on them
        # (evaluation with the user's rewards, no preset or synthetic task with a checkpoint or
        # dataset). A form that sends every field is a complete config and is read as one.
        return RunConfig.from_dict(self.model_dump(exclude_unset=True))
