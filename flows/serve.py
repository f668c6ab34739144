"""The deployments `grpo serve` serves against a Prefect server: the full pipeline, evaluation
of a checkpoint, and readiness alone. Served deployments run in this process's runner; for
work pools (Kubernetes, Vertex AI) see deployments/prefect.yaml, which names the same flows.

Parameters are the typed RunParams, so the UI shows a form and the server rejects invalid
values before a run starts (enforce_parameter_schema). The pipeline deployment runs one flow
run at a time (concurrency_limit=1): two runs never share one accelerator.
"""

from __future__ import annotations

from typing import Any

from flows.pipeline import grpo_evaluate, grpo_pipeline, grpo_readiness


def build_deployments(
    parameters: dict[str, Any] | None = None, cron: str | None = None, interval: float | None = None
) -> list:
    schedule = {"cron": cron} if cron else {"interval": interval} if interval else {}
    params = {"config": parameters} if parameters else {}
    return [
        grpo_pipeline.to_deployment(
            name="pipeline",
            parameters=params,
            enforce_parameter_schema=True,
            concurrency_limit=1,
            tags=["grpo"],
            description="GRPO end to end: data -> readiness -> training epochs -> evaluation -> summary",
            **schedule,
        ),
        grpo_evaluate.to_deployment(
            name="evaluate",
            enforce_parameter_schema=True,
            concurrency_limit=1,
            tags=["grpo"],
            description="Evaluate checkpoints of a run",
        ),
        grpo_readiness.to_deployment(
            name="readiness", enforce_parameter_schema=True, tags=["grpo"], description="Preflight checks alone"
        ),
    ]


def serve(
    parameters: dict[str, Any] | None = None, cron: str | None = None, interval: float | None = None, limit: int = 1
) -> None:
    """Serve until interrupted. `limit` bounds concurrent flow runs of this process."""
    from prefect import serve as prefect_serve

    prefect_serve(*build_deployments(parameters, cron, interval), limit=limit)
