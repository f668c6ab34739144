"""The run form as Prefect's UI builds it from the parameter schema: a field the user leaves as the
form shows it means "the default for this config", exactly as a key left out on the command line;
the fields a user changes come first, every field says what it does, its bounds and its default."""

import json

import pytest

from flows.params import RunParams
from grpo_core.config.run import load_config


def _resolve(schema: dict, node: dict) -> dict:
    if "$ref" in node:
        return schema["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    objects = [_resolve(schema, n) for n in node.get("anyOf", ()) if "$ref" in n]
    return objects[0] if objects else node


def form_values(schema: dict, node: dict | None = None) -> dict:
    """What the UI submits when nothing is touched: each property's default, objects filled in,
    false for a switch without a default (Prefect's UI sends an untouched checkbox as false)."""
    node = node or schema
    out = {}
    for name, prop in node["properties"].items():
        sub = _resolve(schema, prop)
        if "default" in prop:
            out[name] = prop["default"]
        elif "properties" in sub:
            out[name] = form_values(schema, sub)
        elif prop.get("type") == "boolean":
            out[name] = False
    return out


def submit(**changes) -> dict:
    """The flow's parameters when the form is submitted with `changes` ("data.source": ...) made."""
    values = form_values(RunParams.model_json_schema())
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        d = values
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = value
    return values


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_untouched_form_fields_mean_the_default_for_this_config(prompts, tmp_path):
    root = str(tmp_path / "runs")
    cases = [
        ({"data.source": prompts}, [f"data.source={prompts}"]),
        ({"rewards": [{"function": "math_answer", "weight": 1.0}]}, ['rewards=[{"function": "math_answer"}]']),
        ({"num_steps": 7, "epochs": 1}, ["train.num_steps=7", "pipeline.epochs=1"]),  # the form's top fields
        ({"train.num_steps": 7, "pipeline.epochs": 1}, ["train.num_steps=7", "pipeline.epochs=1"]),  # the API's
        ({"model.preset": "small"}, ["model.preset=small"]),
    ]
    for changes, sets in cases:
        form = RunParams.model_validate(submit(**{"storage.root": root, **changes})).to_config()
        cli = load_config(None, [f"storage.root={root}", *sets])
        assert form.to_dict() == cli.to_dict(), changes
    # what the issue saw: the synthetic task's prompt length and evaluation reward no longer leak in
    own_data = RunParams.model_validate(submit(**{"data.source": prompts})).to_config()
    assert own_data.data.max_prompt_tokens == 512 and own_data.train.sampling.max_new_tokens == 256  # the hf recipe
    math = RunParams.model_validate(submit(rewards=[{"function": "math_answer", "weight": 1.0}])).to_config()
    assert [r.function for r in math.eval_rewards] == ["math_answer"] and math.eval.accuracy_reward == "math_answer"


def test_the_cli_config_sent_whole_is_the_same_config():
    # grpo run sends config.to_dict(): explicit nulls (max_grad_norm: off) keep their meaning
    cli = load_config(None, ["train.optimizer.max_grad_norm=null", "model.lora.rank=4"])
    sent = RunParams.model_validate(cli.to_dict()).to_config()
    assert sent.to_dict() == cli.to_dict() and sent.train.optimizer.max_grad_norm is None


def _as_the_form_shows(schema: dict) -> list[str]:
    """Every field's dotted path in the order Prefect's form shows them: each section's fields
    sorted by `position` (a field without one first, as the UI does), subsections inline."""
    out: list[str] = []

    def walk(props: dict, prefix: str) -> None:
        for name, prop in sorted(props.items(), key=lambda kv: kv[1].get("position", 0)):
            ref = prop.get("$ref")
            if ref:
                walk(schema["$defs"][ref.rsplit("/", 1)[1]]["properties"], f"{prefix}{name}.")
            else:
                out.append(prefix + name)

    walk(schema["properties"], "")
    return out


def test_the_form_leads_with_the_fields_users_change():
    schema = RunParams.model_json_schema()
    defs = schema["$defs"]
    shown = _as_the_form_shows(schema)
    # issue 30, item 3: what a run needs first (before: storage and run folder first, the
    # advanced Training subsections before pipeline.epochs, which sat at 75 % of the form; then
    # epochs and steps the first fields of their sections, at 20 % and 42 %)
    assert shown[:3] == ["num_steps", "epochs", "data.source"]
    assert [f for f in shown if "." not in f or f.endswith((".source", ".path"))][:6] == [
        "num_steps",
        "epochs",
        "data.source",
        "model.path",
        "rewards",
        "run_name",
    ]
    assert shown.index("rewards") < 0.3 * len(shown) and shown.index("rewards") < shown.index("train.num_epochs")
    assert "train.num_steps" not in shown and "pipeline.epochs" not in shown  # one field each in the form
    assert list(defs["ModelParams"]["properties"])[:2] == ["path", "preset"]
    # every section's fields carry their place: the UI puts a field without one first
    for name, d in [("RunParams", schema), *defs.items()]:
        assert [p.get("position") for p in d["properties"].values()] == list(range(len(d["properties"]))), name
    # one "Run name" in the UI: Prefect's own flow-run name field; ours is the run's folder
    assert schema["properties"]["run_name"]["title"] == "Run folder"
    titles = [d["title"] for d in defs.values()]
    assert not [t for t in titles if t.endswith("Params")], titles
    assert "Training (advanced): optimizer" in titles


def test_steps_and_epochs_keep_their_place_in_a_config():
    """The form shows train.num_steps and pipeline.epochs at its top; every way a config spells
    them still works (API calls, deployments' YAML, --set, grpo run's config sent whole): the
    server's schema check accepts it and the run is the same config, the same hash."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    from flows.pipeline import grpo_pipeline

    cli = load_config(None, ["train.num_steps=7", "pipeline.epochs=1", "train.grpo.prompts_per_step=4"])
    spellings = [
        {"train": {"num_steps": 7, "grpo": {"prompts_per_step": 4}}, "pipeline": {"epochs": 1}},  # API, YAML
        {"num_steps": 7, "epochs": 1, "train": {"grpo": {"prompts_per_step": 4}}},  # the form
        {"epochs": None, "train": {"num_steps": 7, "grpo": {"prompts_per_step": 4}}, "pipeline": {"epochs": 1}},
        cli.to_dict(),  # grpo run
    ]
    # what the server checks a deployment's parameters against (enforce_parameter_schema)
    schema = parameter_schema(grpo_pipeline.fn).model_dump_for_openapi()
    for config in spellings[:3]:  # grpo run's config runs the flow in its own process: pydantic checks it
        assert validate({"config": config}, schema, raise_on_error=False) == [], config
    for config in spellings:
        form = RunParams.model_validate(config)
        assert form.to_config().to_dict() == cli.to_dict() and form.to_config().name == cli.name, config
        # written out (grpo serve's deployment parameters): at the top, where the form shows them
        dumped = form.model_dump(exclude_unset=True)
        assert dumped["num_steps"] == 7 and dumped["epochs"] == 1 and "num_steps" not in dumped["train"], dumped
        assert RunParams.model_validate(dumped).to_config().name == cli.name
    for bad in ({"train": {"num_steps": 0}}, {"pipeline": {"epochs": 0}}, {"epochs": 0}, {"train": {"nope": 1}}):
        assert validate({"config": bad}, schema, raise_on_error=False), bad  # refused before a run exists
    # a deployment whose parameters say train.num_steps: the form keeps that value out of sight
    # and submits it beside the top field; what the user typed there wins
    typed = RunParams.model_validate({"num_steps": 3, "train": {"num_steps": 7}}).to_config()
    assert typed.train.num_steps == 3
    assert RunParams.model_validate({"train": {"num_steps": None}}).to_config().name == RunParams().to_config().name


def test_every_field_is_described_with_its_bounds_and_default():
    schema = RunParams.model_json_schema()
    missing, unbounded = [], []
    for dname, d in [("RunParams", schema), *schema["$defs"].items()]:
        for name, prop in d["properties"].items():
            if not prop.get("description"):
                missing.append(f"{dname}.{name}")
            kinds = prop.get("anyOf", [prop])
            if any(k in t for t in kinds for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")):
                if "Allowed:" not in prop.get("description", ""):
                    unbounded.append(f"{dname}.{name}")
    assert not missing and not unbounded, (missing, unbounded)
    steps = schema["properties"]["num_steps"]["description"]
    assert (
        "≥ 1" in steps and 'Empty: the default for this config ("auto"; on the built-in synthetic task: 600)' in steps
    )
    assert steps.endswith("In a config file, the API or --set: train.num_steps.")
    prompt = schema["$defs"]["DataParams"]["properties"]["max_prompt_tokens"]["description"]
    assert "(512; on the built-in synthetic task: 16)" in prompt


def test_evaluate_and_readiness_parameters_are_described():
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import grpo_evaluate, grpo_pipeline, grpo_readiness

    for flow in (grpo_pipeline, grpo_evaluate, grpo_readiness):
        props = parameter_schema(flow.fn).model_dump()["properties"]
        assert props and all(p.get("description") for p in props.values()), (flow.name, props)


def test_optional_sections_have_an_enable_switch_not_a_none_choice():
    """issue 30, item 3: LoRA and train.mesh.rollout/reference rendered as a null/object choice
    ('Property is type "None"'); now a plain switch, off by default, and configs as before."""
    schema = RunParams.model_json_schema()
    nulls = [
        f"{d}.{name}"
        for d, sec in [("RunParams", schema), *schema["$defs"].items()]
        for name, prop in sec["properties"].items()
        if any(k.get("type") == "null" for k in prop.get("anyOf", ())) and any("$ref" in k for k in prop["anyOf"])
    ]
    assert nulls == []
    for section in ("LoraParams", "TrainMeshRolloutParams", "TrainMeshReferenceParams"):
        enabled = schema["$defs"][section]["properties"]["enabled"]
        assert enabled["type"] == "boolean" and enabled["default"] is False and enabled["position"] == 0, section
    assert (
        "Off (the default): full fine-tuning" in schema["$defs"]["LoraParams"]["properties"]["enabled"]["description"]
    )
    # the untouched form, old configs with lora: null, and the CLI's mapping mean what they did
    assert RunParams().to_config().name == "tiny-ecc6c5c9" == load_config(None, []).name  # grpo demo's run
    assert RunParams.model_validate({"model": {"lora": None}}).to_config().model.lora is None
    assert RunParams.model_validate({"model": {"lora": {"enabled": False, "rank": 4}}}).to_config().model.lora is None
    assert RunParams.model_validate({"model": {"lora": {"enabled": True, "rank": 4}}}).to_config().model.lora.rank == 4
    assert RunParams.model_validate({"model": {"lora": {"rank": 4}}}).to_config().model.lora.rank == 4
    rollout = {"data": 1, "fsdp": 1, "tensor": -1}
    mesh = RunParams.model_validate({"train": {"mesh": {"rollout": rollout}}}).to_config().train.mesh
    assert mesh.rollout is not None and mesh.rollout.tensor == -1 and mesh.reference is None
    assert RunParams.model_validate({"train": {"mesh": {"rollout": None}}}).to_config().train.mesh.rollout is None
    assert RunParams().model_dump()["model"]["lora"] == {"enabled": False}  # the deployment's default parameters


def test_the_everyday_form_is_a_dozen_fields_of_the_full_form(prompts, tmp_path):
    """issue 54: grpo-pipeline/train's parameters are the fields a person sets on most runs, typed,
    in the order they change, each with its default said; each sets one key of the full form, so a
    run started from it is the run the CLI starts with that key (and the untouched form, the demo)."""
    from prefect.utilities.schema_tools import validate

    from flows.everyday import EVERYDAY, everyday_config, grpo_train

    schema = grpo_train.parameters.model_dump()
    props = schema["properties"]
    assert list(props) == list(EVERYDAY) and len(props) <= 12 and schema["required"] == []
    assert list(props)[:5] == ["data_source", "model_path", "rewards", "num_steps", "run_name"]
    for name, prop in props.items():
        assert prop["title"] == EVERYDAY[name][1] and prop["position"] == list(props).index(name), name
        # the default said, or shown filled in; no null for the form to offer ('Property is type "None"')
        assert "Empty: " in prop["description"] or "(the default)" in prop["description"], (name, prop)
        assert "null" not in str(prop.get("anyOf")) and prop.get("default", "") is not None, (name, prop)
    assert {k: p["default"] for k, p in props.items() if "default" in p} == {
        "epochs": 4,
        "lora": False,
        "storage_root": "runs",
    }
    assert 'Empty: the default for this config ("tiny")' in props["model_preset"]["description"]
    root = str(tmp_path / "runs")
    cases = [
        ({"data_source": prompts, "new_tokens": 48}, [f"data.source={prompts}", "train.sampling.max_new_tokens=48"]),
        ({"model_path": "Qwen/Qwen3-0.6B"}, ["model.path=Qwen/Qwen3-0.6B"]),
        ({"model_preset": "small"}, ["model.preset=small"]),
        ({"rewards": [{"function": "math_answer", "weight": 1.0}]}, ['rewards=[{"function": "math_answer"}]']),
        ({"num_steps": 7, "epochs": 1}, ["train.num_steps=7", "pipeline.epochs=1"]),
        ({"run_name": "nightly-{date}"}, ["run_name=nightly-{date}"]),
        ({"learning_rate": 1e-5, "lora": True}, ["train.optimizer.learning_rate=1e-5", "model.lora={}"]),
        ({"data_source": "", "model_path": None, "rewards": []}, []),  # empty, however given: the default
    ]
    for values, sets in cases:
        # what the form submits: the fields shown filled in, as they are, and the ones changed
        form = everyday_config({"epochs": 4, "lora": False, "storage_root": root, **values})
        assert form.to_dict() == load_config(None, [f"storage.root={root}", *sets]).to_dict(), values
    assert everyday_config({}).name == load_config(None, []).name == "tiny-ecc6c5c9"  # the demo, as grpo demo
    # the server's check (enforce_parameter_schema): the full form's bounds and choices, null is empty
    assert validate({}, schema, raise_on_error=False) == []
    assert validate({"data_source": None, "num_steps": 3}, schema, raise_on_error=False) == []
    for bad in ({"num_steps": 0}, {"learning_rate": 0}, {"new_tokens": 0}, {"model_preset": "huge"}, {"lora": "x"}):
        assert validate(bad, schema, raise_on_error=False), bad


def test_grpo_serve_gives_the_everyday_form_the_served_values_of_its_fields():
    """`grpo serve --config/--set`: the everyday deployment's parameters are the served config's
    values of its fields; the keys it has no field for are named (its description, grpo serve's log)."""
    from flows.everyday import everyday_defaults

    served = RunParams.model_validate({"train": {"num_steps": 4, "grpo": {"prompts_per_step": 4}}})
    values, rest = everyday_defaults(
        {
            **served.model_dump(exclude_unset=True),
            "storage": {"root": "gs://b/runs"},
            "model": {"lora": {"enabled": True, "rank": 4}},
            "data": {"source": "d.jsonl", "eval_rows": 8},
        }
    )
    assert values == {"num_steps": 4, "storage_root": "gs://b/runs", "lora": True, "data_source": "d.jsonl"}
    assert sorted(rest) == ["data.eval_rows", "model.lora.rank", "train.grpo.prompts_per_step"]
    assert everyday_defaults(None) == ({}, [])
