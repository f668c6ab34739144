"""deployments/: every deployment names a flow that loads, enforces its parameter schema, is
limited to one run at a time and never takes a name `grpo serve` owns; the GKE job template is
valid and uses only its own variables."""

import json
import pathlib
import re

import yaml
from prefect.flows import load_flow_from_entrypoint

from flows.cli import main
from flows.serve import SERVED_NAMES

ROOT = pathlib.Path(__file__).resolve().parents[1]


# each file deploys to its own work pool; none uses a name `grpo serve` owns (flows/serve.py)
FILES = {"prefect.yaml": "grpo-local", "gke-tpu.yaml": "grpo-gke-tpu", "vertex.yaml": "grpo-vertex"}
SERVED = {tuple(name.split("/")) for name in SERVED_NAMES}


def _spec(name: str) -> dict:
    return yaml.safe_load((ROOT / "deployments" / name).read_text())


def test_prefect_yaml_deployments_load():
    named = set()
    for file, pool in FILES.items():
        spec = _spec(file)
        assert spec["pull"][0] == {"flows.serve.require_project_dir": {}}
        for d in spec["deployments"]:
            flow = load_flow_from_entrypoint(str(ROOT / d["entrypoint"]))
            assert flow.name.startswith("grpo-") and d["enforce_parameter_schema"] is True
            assert d["work_pool"]["name"] == pool
            if flow.name != "grpo-readiness":
                assert d["concurrency_limit"]["limit"] == 1
            named.add((flow.name, d["name"]))
    assert not named & SERVED
    assert {("grpo-pipeline", "pool"), ("grpo-pipeline", "pool-nightly"), ("grpo-evaluate", "pool")} <= named
    assert {("grpo-pipeline", "pool-resume"), ("grpo-evaluate", "pool-evaluate-nightly")} <= named
    assert {("grpo-readiness", "pool"), ("grpo-pipeline", "gke-tpu"), ("grpo-pipeline", "vertex")} <= named


def test_the_scheduled_patterns_are_valid_and_the_readme_shows_them_as_deployed():
    """The three scheduled patterns: schedules off (a placeholder bucket), parameters the flows
    accept, and the docs' YAML for each (docs/deploying.md) exactly the deployment in prefect.yaml."""
    from flows.params import RunParams
    from flows.pipeline import grpo_evaluate
    from grpo_core.config.run import RunConfig

    deployed = {d["name"]: d for d in _spec("prefect.yaml")["deployments"]}
    page = (ROOT / "docs" / "deploying.md").read_text()
    shown = re.findall(r"<!-- deployment: ([\w-]+) -->\n```yaml\n(.*?)```", page, re.S)
    assert [name for name, _ in shown] == ["pool-resume", "pool-nightly", "pool-evaluate-nightly"]
    for name, text in shown:
        d = deployed[name]
        assert yaml.safe_load(text) == [d], name
        assert [s.get("active") for s in d["schedules"]] == [False]
        assert d.get("paused") is True and d.get("description"), name  # the UI's list: paused, described
        if d["entrypoint"].endswith("grpo_pipeline"):
            cfg = RunParams.model_validate(d["parameters"]["config"]).to_config()  # the form's and the flow's reading
            assert isinstance(cfg, RunConfig)
        else:
            grpo_evaluate.validate_parameters(d["parameters"])
    nightly = deployed["pool-nightly"]
    assert nightly["schedules"][0]["cron"] == "0 2 * * *"
    assert nightly["parameters"]["config"]["run_name"] == "nightly-{date}"
    assert nightly["parameters"]["config"]["model"]["init_from"] == "nightly-*"
    assert deployed["pool-resume"]["concurrency_limit"]["collision_strategy"] == "CANCEL_NEW"
    assert deployed["pool-evaluate-nightly"]["parameters"]["steps"] == []


def test_gke_job_template_variables():
    template = json.loads((ROOT / "deployments" / "work-pools" / "gke-tpu.json").read_text())
    declared = set(template["variables"]["properties"])
    used = set(re.findall(r"\{\{ (\w+) \}\}", json.dumps(template["job_configuration"])))
    assert used <= declared, used - declared
    [gke] = _spec("gke-tpu.yaml")["deployments"]
    assert set(gke["work_pool"]["job_variables"]) <= declared


def test_serve_needs_a_server(monkeypatch, capsys):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["serve"]) == 2
    assert "prefect server start" in capsys.readouterr().err
