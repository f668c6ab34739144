"""Multi-host JAX for the worker: one process per host (or per local group of devices), joined
by jax.distributed into one set of devices that every jitted program spans.

A launcher (grpo_core.launch.launchers) starts the same worker command on every host and tells each
process who it is through the environment:

    GRPO_COORDINATOR=host:port  GRPO_NUM_PROCESSES=N  GRPO_PROCESS_ID=i   explicit (local, Ray)
    GRPO_DISTRIBUTED=auto                                                  JAX detects the cluster
                                                                           (TPU VM metadata, SLURM, ...)

`python -m grpo_core.stages.worker --distributed ...` asks for `auto` when no coordinator is given.
GRPO_INIT_TIMEOUT_S (default 300) bounds the wait for every process to join;
GRPO_HEARTBEAT_TIMEOUT_S (default 100) how long a silent process is tolerated before the
others fail instead of hanging in a collective. CPU devices talk through gloo, so N processes on
127.0.0.1 are a faithful stand-in for N hosts (that is how the tests run multi-host code).

Rules the rest of the worker follows: process 0 alone writes markers, metrics and events
(`is_primary`); every process feeds identical host arrays to each computation (mesh.put);
and before training the processes check that they agree on the config and the first batch
(`disagreements`, one collective).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import os
from typing import Any, Mapping

import numpy as np

from grpo_core.errors import DistributedError

log = logging.getLogger(__name__)

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "GRPO_COORDINATOR", "GRPO_NUM_PROCESSES", "GRPO_PROCESS_ID"
ENV_DISTRIBUTED = "GRPO_DISTRIBUTED"
ENV_INIT_TIMEOUT, ENV_HEARTBEAT_TIMEOUT = "GRPO_INIT_TIMEOUT_S", "GRPO_HEARTBEAT_TIMEOUT_S"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """How this process joins the others. coordinator None: JAX detects the cluster itself."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    init_timeout_s: int = 300
    heartbeat_timeout_s: int = 100


def from_env(env: Mapping[str, str] | None = None, requested: bool = False) -> Cluster | None:
    """The cluster the environment describes; None for a single process. `requested`: the
    worker's --distributed flag (auto-detection unless a coordinator is given)."""
    env = os.environ if env is None else env

    def integer(name: str, default: int | None = None, low: int = 0) -> int | None:
        raw = env.get(name)
        if raw in (None, ""):
            return default
        try:
            value = int(raw)
        except ValueError:
            raise DistributedError(f"{name} must be an integer, got {raw!r}") from None
        if value < low:
            raise DistributedError(f"{name} must be >= {low}, got {value}")
        return value

    timeouts = dict(
        init_timeout_s=integer(ENV_INIT_TIMEOUT, 300, 1), heartbeat_timeout_s=integer(ENV_HEARTBEAT_TIMEOUT, 100, 1)
    )
    coordinator = env.get(ENV_COORDINATOR) or None
    if coordinator is None:
        mode = env.get(ENV_DISTRIBUTED, "").lower()
        if mode not in ("", "0", "auto", "1"):
            raise DistributedError(f"{ENV_DISTRIBUTED} must be 'auto' (or unset), got {env.get(ENV_DISTRIBUTED)!r}")
        return Cluster(**timeouts) if requested or mode in ("auto", "1") else None
    if ":" not in coordinator:
        raise DistributedError(f"{ENV_COORDINATOR} must be host:port, got {coordinator!r}")
    n, i = integer(ENV_NUM_PROCESSES, low=1), integer(ENV_PROCESS_ID)
    if n is None or i is None:
        raise DistributedError(f"{ENV_COORDINATOR} is set, so {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be too")
    if i >= n:
        raise DistributedError(f"{ENV_PROCESS_ID} must be < {ENV_NUM_PROCESSES} ({n}), got {i}")
    return Cluster(coordinator, n, i, **timeouts)


def initialize(cluster: Cluster | None) -> None:
    """Join the cluster before anything touches a JAX backend. CPU devices get gloo collectives
    (without them a CPU program spanning processes has no way to communicate)."""
    if cluster is None:
        return
    import jax  # launch/ is JAX-free: only worker processes call this

    platforms = (os.environ.get("JAX_PLATFORMS") or str(jax.config.jax_platforms or "")).lower()
    if platforms.split(",")[0] == "cpu" and "jax_cpu_collectives_implementation" in jax.config.values:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # The coordinator (process 0) listens on the address the others dial, not on every interface.
    kw: dict[str, Any] = dict(
        coordinator_address=cluster.coordinator,
        num_processes=cluster.num_processes,
        process_id=cluster.process_id,
        initialization_timeout=cluster.init_timeout_s,
        heartbeat_timeout_seconds=cluster.heartbeat_timeout_s,
        coordinator_bind_address=cluster.coordinator,
    )
    accepted = inspect.signature(jax.distributed.initialize).parameters
    kw = {k: v for k, v in kw.items() if k in accepted and (v is not None or k == "coordinator_address")}
    try:
        jax.distributed.initialize(**kw)
    except Exception as exc:  # noqa: BLE001 - JAX raises RuntimeError/XlaRuntimeError/ValueError here
        who = (
            f"process {cluster.process_id} of {cluster.num_processes} at {cluster.coordinator}"
            if cluster.coordinator
            else "auto-detected cluster"
        )
        raise DistributedError(
            f"jax.distributed.initialize failed ({who}, {cluster.init_timeout_s} s to join): {exc}"
        ) from exc
    log.info(
        "process %d of %d; %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def process_index() -> int:
    import jax  # launch/ is JAX-free: only worker processes call this

    return jax.process_index()


def is_primary() -> bool:
    """Process 0: the one that writes markers, metrics and events."""
    return process_index() == 0


def digest(value: Any) -> str:
    """A stable hash of a JSON-able value (a config hash, a batch of prompt rows)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def disagreements(values: Mapping[str, str]) -> dict[str, list[int]]:
    """For each named value, the processes whose value differs from process 0's ({} when all
    agree); one collective. Every process must call it with the same names."""
    import jax  # launch/ is JAX-free: only worker processes call this

    if jax.process_count() == 1:
        return {}
    from jax.experimental import multihost_utils  # JAX, as above

    names = sorted(values)
    mine = np.stack([np.frombuffer(hashlib.sha256(str(values[n]).encode()).digest(), np.uint8) for n in names])
    every = np.asarray(multihost_utils.process_allgather(mine))  # (processes, names, 32)
    out = {}
    for j, n in enumerate(names):
        differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p, j], every[0, j])]
        if differ:
            out[n] = differ
    return out


def first_batch_digest(prompts, step: int, n: int) -> str:
    """The digest of the prompt rows step `step` draws first (what every process must feed)."""
    return digest(prompts.sample(step, 0, n))
