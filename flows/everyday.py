"""The everyday form: the deployment grpo-pipeline/train, whose parameters are the dozen fields a
person sets on most runs (EVERYDAY), ordered by how often they change. Its flow runs the same
pipeline as grpo-pipeline/pipeline (flows.pipeline.run_pipeline), through the same trust check
(flows.pipeline._allowed), under the same flow name, so both deployments' runs share one list.

Why a second deployment rather than one `overrides` field beside the dozen: the full form
(grpo-pipeline/pipeline, `config: RunParams`) stays typed field by field, with the CLI's keys,
bounds, choices, descriptions and the server's checks, where an `overrides` field would be one
JSON text box, the opaque thing the Parameters tab showed before; and the API's `config`, the
work-pool deployments and `grpo serve`'s schedules keep their spelling.

Each parameter here is a field of the full form (flows.params.RunParams): its type, bounds and
description come from there (one source) and it sets that key, so a run started here is the run
the full form or the CLI starts with those keys. The parameters are the flow's own, not one model:
Prefect lists a flow's parameters one by one in the deployment's Parameters tab and in the run
form, in the order the function declares them.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Callable

from annotated_types import MinLen
from prefect import flow, get_run_logger
from pydantic import MISSING, BaseModel, Field
from pydantic.fields import FieldInfo
from pydantic.json_schema import SkipJsonSchema

from flows.params import _DEFAULTS, _ON_USER_DATA, _TOP, RunParams
from flows.pipeline import Refused, _allowed, _run_named, readiness_run, run_pipeline
from grpo_core.agent.builtin import BUILTIN_TOOLS
from grpo_core.config.model import LoraConfig
from grpo_core.config.run import RunConfig

# parameter: (the key it sets in RunParams, its title in the form, whether the form shows its
# default filled in: a default that is the same for every config; the others are empty, and an
# empty field is the default for this config, as in the full form and on the command line).
# In the order they change: what a run trains on, from and for (data, model, rewards), how long,
# where it lands; the tools its episodes may call; then what a user tunes (the learning rate, how
# long a completion may be, epochs, LoRA); last what is set once (a preset, used only without a
# model path, and the operator's storage root). The data's format is detected (data.format: auto);
# the full form sets it.
EVERYDAY: dict[str, tuple[str, str, bool]] = {
    "data_source": ("data.source", "Data source", False),
    "model_path": ("model.path", "Model path", False),
    "rewards": ("rewards", "Rewards", False),
    "num_steps": ("num_steps", "Steps", False),
    "run_name": ("run_name", "Run folder (run_name)", False),
    "tools": ("train.agent.tools", "Tools", False),
    "learning_rate": ("train.optimizer.learning_rate", "Learning rate", False),
    "new_tokens": ("train.sampling.max_new_tokens", "New tokens per completion", False),
    "epochs": ("epochs", "Epochs", True),
    "lora": ("model.lora", "LoRA", True),
    "model_preset": ("model.preset", "Model preset", False),
    "storage_root": ("storage.root", "Storage root", True),
}


def _form_field(key: str) -> FieldInfo:
    """The full form's field at `key` (a top field, or one in a section: data.source)."""
    *sections, name = key.split(".")
    model: type[BaseModel] = RunParams
    for section in sections:
        model = model.model_fields[section].annotation
    return model.model_fields[name]


def _type(name: str) -> Any:
    """The parameter's type: the full form's field's, with its bounds, less its null and its
    minimum length (an empty text or list is an empty field here). An empty field is left out of
    the schema's defaults (MISSING), so the form shows it empty and submits nothing; null through
    the API means the same (SkipJsonSchema: accepted, not offered as a choice in the form)."""
    key, _, shown = EVERYDAY[name]
    if name == "lora":
        return bool  # a switch: on, the LoRA section's defaults
    f = _form_field(key)
    kinds = typing.get_args(f.annotation) if typing.get_origin(f.annotation) in (typing.Union, types.UnionType) else ()
    inner = [k for k in kinds if k is not type(None)] or [f.annotation]
    # a number's word (num_steps: auto) is what the empty field gives on your data: one input, no
    # int/str choice in the form (the full form offers the word)
    inner = [k for k in inner if typing.get_origin(k) is not typing.Literal] or inner
    base = inner[0] if len(inner) == 1 else typing.Union[tuple(inner)]
    bounds = [m for m in f.metadata if not isinstance(m, MinLen)]
    typed = typing.Annotated[(base, *bounds)] if bounds else base
    return typed if shown else typed | SkipJsonSchema[None] | MISSING


def _description(name: str) -> str:
    """The full form's description, less what the short form needs not say (where a config file
    keeps a top field, a minimum length: an empty field is the default here)."""
    key, _, _ = EVERYDAY[name]
    text = (_form_field(key).description or "").split(" In a config file, the API or --set:")[0]
    text = text.replace(" Allowed: length ≥ 1.", "")
    if name == "num_steps":  # the form offers no "auto" (see _type): say where the empty field gives it
        user, demo = _ON_USER_DATA["train"]["num_steps"], _DEFAULTS["train"]["num_steps"]
        return (
            f"GRPO steps in the whole run. Allowed: ≥ 1. Empty: {user} on your data or model (train.num_epochs "
            f"passes over its training rows), {demo} on the built-in synthetic task."
        )
    if name == "tools":  # as the rewards field says its names; and what empty means: no episodes
        return (
            f"{text.split('. Empty:')[0]} (train.agent.tools). Built-in: {', '.join(sorted(BUILTIN_TOOLS))}. A "
            "deployment run may name the built-ins and the files and modules the operator allowed for rewards. "
            "Empty: the default for this config (none: each completion is one turn)."
        )
    if name == "lora":
        lora = LoraConfig()
        return text.replace(
            "Empty: full fine-tuning",
            f"Off (the default): full fine-tuning. On: rank {lora.rank}, alpha {lora.alpha} on every decoder "
            "linear (grpo-pipeline/pipeline's form sets them).",
        )
    return text if text.endswith(".") else f"{text}."


def _shown_default(key: str) -> Any:
    if key == "model.lora":
        return False
    value: Any = _DEFAULTS
    for part in (f"{_TOP[key]}.{key}" if key in _TOP else key).split("."):  # a top field: where a config keeps it
        value = value[part]
    return value


def everyday(name: str) -> Any:
    """The parameter `name`'s default, description and title (Prefect titles a parameter with its
    name unless the schema's extra says otherwise)."""
    key, title, shown = EVERYDAY[name]
    default = _shown_default(key) if shown else MISSING
    return Field(default, description=_description(name), json_schema_extra={"title": title})


EVERYDAY_TYPES: dict[str, Any] = {name: _type(name) for name in EVERYDAY}


def _empty(value: Any) -> bool:
    return value is MISSING or value is None or value == "" or value == []


def everyday_params(values: dict[str, Any]) -> RunParams:
    """The full form's parameters for the everyday form's `values`: each value given at its key;
    one left empty (out, null, "" or []) is the default for this config."""
    tree: dict[str, Any] = {}
    for name, (key, _, _) in EVERYDAY.items():
        value = values.get(name, MISSING)
        if _empty(value):
            continue
        if name == "lora":
            value = {"enabled": bool(value)}
        *sections, leaf = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return RunParams.model_validate(tree)


def everyday_config(values: dict[str, Any]) -> RunConfig:
    return everyday_params(values).to_config()


def _leaves(model: type[BaseModel], values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`values` (a RunParams dump) as {dotted key: value}, down to the form's fields."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        f = model.model_fields.get(k)
        sub = f.annotation if f is not None else None
        if isinstance(v, dict) and isinstance(sub, type) and issubclass(sub, BaseModel):
            out.update(_leaves(sub, v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def everyday_defaults(params: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """The everyday deployment's parameters for a served config (`grpo serve --config/--set`, as
    RunParams dumps it): the values of its fields, and the config keys it has no field for (those
    apply to grpo-pipeline/pipeline's runs only)."""
    by_key = {key: name for name, (key, _, _) in EVERYDAY.items()}
    values: dict[str, Any] = {}
    rest: list[str] = []
    for key, value in _leaves(RunParams, params or {}).items():
        if key in ("model.lora.enabled", "model.lora"):
            values["lora"] = bool(value)
        elif key in by_key:
            values[by_key[key]] = value
        else:
            rest.append(key)
    return values, rest


T = types.SimpleNamespace(**EVERYDAY_TYPES)  # the parameters' types, below: T.data_source, ...


def _everyday_flow(name: str, doc: str, run: Callable[[RunConfig, Any], Any]) -> Callable[..., Any]:
    """A flow function named `name` whose parameters are the everyday form's fields (EVERYDAY, in
    its order: Prefect's form lists them so), which runs `run(config, logger)` on the config they
    make once the trust check allows it; a refusal (the config, or the run folder it names: see
    check_run_root) ends the flow run Failed with its message."""

    def everyday_flow(
        data_source: T.data_source = everyday("data_source"),
        model_path: T.model_path = everyday("model_path"),
        rewards: T.rewards = everyday("rewards"),
        num_steps: T.num_steps = everyday("num_steps"),
        run_name: T.run_name = everyday("run_name"),
        tools: T.tools = everyday("tools"),
        learning_rate: T.learning_rate = everyday("learning_rate"),
        new_tokens: T.new_tokens = everyday("new_tokens"),
        epochs: T.epochs = everyday("epochs"),
        lora: T.lora = everyday("lora"),
        model_preset: T.model_preset = everyday("model_preset"),
        storage_root: T.storage_root = everyday("storage_root"),
    ) -> dict[str, Any]:
        values = {k: v for k, v in locals().items() if k in EVERYDAY}  # the parameters (not `run`)
        log = get_run_logger()
        try:
            cfg = _allowed(lambda: everyday_config(values), log)  # before anything runs, is read or written
            return run(cfg, log)
        except Refused as refused:
            return refused.state

    everyday_flow.__name__ = everyday_flow.__qualname__ = name  # its entrypoint: flows/everyday.py:<name>
    everyday_flow.__doc__ = doc
    return everyday_flow


grpo_train = flow(
    name="grpo-pipeline",
    retries=1,
    retry_delay_seconds=5,
    flow_run_name=_run_named(config_of=everyday_config),
)(
    _everyday_flow(
        "grpo_train",
        """Run GRPO end to end with the fields most runs set (prepare the data, check readiness, train
    in epochs, evaluate, export, summarize); every other key takes the default for this config.
    The same pipeline as grpo-pipeline/pipeline, whose form has every key.""",
        run_pipeline,
    )
)

grpo_check = flow(name="grpo-readiness", flow_run_name=_run_named("readiness-", config_of=everyday_config))(
    _everyday_flow(
        "grpo_check",
        """The readiness checks alone (storage probe, devices, the data, the memory plan), nothing
    trained, for the run grpo-pipeline/train's form would start with these fields: its report as an
    artifact. grpo-readiness/readiness checks a config with every key.""",
        lambda cfg, log: readiness_run(cfg),
    )
)
