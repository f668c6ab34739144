"""deployments/: every deployment names a flow that loads, enforces its parameter schema and is
limited to one run at a time; the GKE job template is valid and uses only its own variables."""

import json
import pathlib
import re

import yaml
from prefect.flows import load_flow_from_entrypoint

from flows.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_prefect_yaml_deployments_load():
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    names = {d["name"] for d in spec["deployments"]}
    assert {"pipeline", "pipeline-nightly", "evaluate", "readiness", "pipeline-gke-tpu", "pipeline-vertex"} <= names
    for d in spec["deployments"]:
        flow = load_flow_from_entrypoint(str(ROOT / d["entrypoint"]))
        assert flow.name.startswith("grpo-") and d["enforce_parameter_schema"] is True
        assert d["work_pool"]["name"] in {"grpo-local", "grpo-gke-tpu", "grpo-vertex"}
        if d["name"] != "readiness":
            assert d["concurrency_limit"]["limit"] == 1
    nightly = next(d for d in spec["deployments"] if d["name"] == "pipeline-nightly")
    assert nightly["schedules"][0]["cron"] == "0 2 * * *"
    from flows.params import RunParams

    RunParams.model_validate(nightly["parameters"]["config"])  # the example parameters are valid


def test_gke_job_template_variables():
    template = json.loads((ROOT / "deployments" / "work-pools" / "gke-tpu.json").read_text())
    declared = set(template["variables"]["properties"])
    used = set(re.findall(r"\{\{ (\w+) \}\}", json.dumps(template["job_configuration"])))
    assert used <= declared, used - declared
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    gke = next(d for d in spec["deployments"] if d["name"] == "pipeline-gke-tpu")
    assert set(gke["work_pool"]["job_variables"]) <= declared


def test_serve_needs_a_server(monkeypatch, capsys):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["serve"]) == 2
    assert "prefect server start" in capsys.readouterr().err
