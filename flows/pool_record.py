"""A work-pool deployment's record on the server against the file that deploys it (deployments/*.yaml).

A worker (`prefect worker start`) loads a flow run's code as the deployment's record on the server
says: it runs the record's pull steps, then imports its entrypoint. Anyone who can PATCH
/api/deployments/{id} can change both, and nothing here can stop that: by the time this project's
flow runs, the pull steps have run, and a changed entrypoint means this project's flow never runs
at all. What the flow can still do is refuse to go on, and say so, when the record is not what the
checked-in file deploys (`pool_record_refusal`, called before anything runs: flows.pipeline._allowed).
The protection is the server's auth string (docs/trust.md).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml
from prefect.client.orchestration import get_client

DEPLOYMENTS = Path(__file__).resolve().parents[1] / "deployments"  # this code's own checkout
CHECKED = ("pull_steps", "entrypoint")


def checked_in(flow_name: str, name: str) -> tuple[str, dict[str, Any]] | None:
    """(file, {pull_steps, entrypoint}) of the deployment `flow_name`/`name` in deployments/*.yaml,
    or None when no file there deploys it."""
    for path in sorted(DEPLOYMENTS.glob("*.yaml")):
        spec = yaml.safe_load(path.read_text()) or {}
        for d in spec.get("deployments") or []:
            if d.get("name") == name and _flow_name(d.get("entrypoint") or "") == flow_name:
                pull = d["pull"] if "pull" in d else spec.get("pull")
                return f"deployments/{path.name}", {"pull_steps": pull or [], "entrypoint": d["entrypoint"]}
    return None


def _flow_name(entrypoint: str) -> str | None:
    """The name of the flow at a file entrypoint of this project (flows/pipeline.py:grpo_pipeline)."""
    file, _, function = entrypoint.partition(":")
    if not file.endswith(".py") or not function:
        return None
    try:
        return getattr(importlib.import_module(file[:-3].replace("/", ".")), function).name
    except (ImportError, AttributeError):
        return None


def pool_record_refusal(deployment_id: UUID | str) -> str | None:
    """Why a flow run of this work-pool deployment may not go on: its record's pull steps or
    entrypoint are not what deployments/*.yaml deploys. None for a served deployment (no work
    pool: grpo serve compared its record before starting the run, flows.serve_runner) and for a
    deployment no file there deploys (the operator's own)."""
    with get_client(sync_client=True) as client:
        record = client.read_deployment(deployment_id)
        if not record.work_pool_name:
            return None
        flow_name = client.read_flow(record.flow_id).name
    found = checked_in(flow_name, record.name)
    if found is None:
        return None
    file, spec = found
    changed = [f for f in CHECKED if (getattr(record, f) or []) != spec[f]]
    if not changed:
        return None
    return (
        f"the deployment {flow_name}/{record.name} on the server is not as {file} deploys it: {', '.join(changed)}. "
        "A worker runs the record's pull steps before this flow starts, so what they do has been done; this run "
        f"goes no further. Deploy the file again (prefect deploy --prefect-file {file}) and give the server an "
        "auth string (docs/trust.md)"
    )
