"""Artifacts of the flow run itself, made from inside a task.

Prefect's `create_*_artifact` called in a task ties the artifact to that task run, and the flow
run's Artifacts tab (Prefect 3.8.8's V1 UI) then lists it under "Task runs" while its own "Flow
run" section says "None". The run's summary and its training progress belong to the flow run: they
are created here with the flow run's id and no task run's (`Artifact.create` would take the task
run's id from the context whatever it is given), so the tab shows them first.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactCreate
from prefect.runtime import flow_run


def flow_run_artifact(kind: str, data: Any, key: str, description: str) -> UUID:
    """A `kind` artifact ("markdown": `data` the text; "progress": `data` the percentage) of this
    flow run, keyed `key`; its id (update_progress_artifact takes it)."""
    fid = flow_run.id
    artifact = ArtifactCreate(
        type=kind, key=key, description=description, data=data, flow_run_id=UUID(fid) if fid else None
    )
    with get_client(sync_client=True) as client:
        return client.create_artifact(artifact=artifact).id
