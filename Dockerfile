# Images for the GKE TPU and Vertex AI work pools (deployments/gke-tpu.yaml, deployments/vertex.yaml):
# this repository installed by scripts/install.sh, the same recipe `make install` and CI run.
#
#   docker build --target cpu -t grpo-pipeline:cpu .
#   docker build --target tpu -t grpo-pipeline:tpu .      # jax[tpu] with libtpu, for TPU VMs and GKE TPU nodes
#
# The Prefect worker runs the flow run's command in the container; GRPO_PROJECT_DIR tells the
# deployments' pull step where the repository is. No credentials are baked in: GCS access comes
# from workload identity or the job's service account.
FROM python:3.11-slim AS base
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY scripts ./scripts
COPY grpo_core ./grpo_core
COPY flows ./flows
COPY tasks ./tasks
COPY deployments ./deployments
RUN useradd --create-home --uid 1000 grpo

FROM base AS cpu
RUN GRPO_DEV=0 scripts/install.sh /opt/venv python3 cpu
ENV PATH=/opt/venv/bin:$PATH GRPO_PROJECT_DIR=/app
USER grpo

FROM base AS tpu
RUN GRPO_DEV=0 scripts/install.sh /opt/venv python3 tpu
ENV PATH=/opt/venv/bin:$PATH GRPO_PROJECT_DIR=/app
USER grpo
