"""The `pipeline.launcher` section: how workers start (grpo_core.launch.launchers starts them)."""

from __future__ import annotations

import enum

from grpo_core.config.fields import Section, Trust, check, field, section


class LauncherKind(enum.Enum):
    LOCAL = "local"  # one process on this machine
    MULTIPROCESS = "multiprocess"  # N processes on 127.0.0.1 with CPU devices: multi-host code on one machine
    RAY = "ray"  # one Ray task per host of a cluster (as Levanter and EasyDeL launch TPU pods)
    TPU_VM = "tpu-vm"  # gcloud compute tpus tpu-vm ssh --worker=all


@section(path="pipeline.launcher")
class LauncherConfig(Section):
    """The `pipeline.launcher` section. Changes no result, so it is in no stage hash."""

    kind: LauncherKind = field(
        LauncherKind.LOCAL,
        doc=(
            "local (one process), multiprocess (N processes on 127.0.0.1 with CPU devices: multi-host code on one "
            "machine), ray (one task per host), tpu-vm (gcloud ssh --worker=all)"
        ),
    )
    # multiprocess: processes here; ray: hosts, one task each
    num_processes: int = field(
        2, doc="multiprocess: processes on this machine; ray: hosts, one task each", ge=1, api_max=64
    )
    # multiprocess: CPU devices of each process
    devices_per_process: int = field(1, doc="multiprocess: CPU devices of each process", ge=1, api_max=64)
    # multiprocess: 0 = a free port; ray: 0 = 8476 on host 0
    coordinator_port: int = field(
        0,
        doc="Port of the jax.distributed coordinator (process 0); 0: a free port (multiprocess) or 8476 (ray)",
        ge=0,
        le=65535,
    )
    # ray: the cluster, as ray.init takes it ("auto", "ray://head:10001", "local")
    address: str = field(
        "auto", doc="ray: the cluster address as ray.init takes it (auto, ray://head:10001)", trust=Trust.ADDRESS
    )
    # ray: each task's resources, e.g. {TPU: 4}; null: {CPU: 1}
    resources_per_host: dict | None = field(
        None, doc="ray: each host task's resources, e.g. {TPU: 4}; empty: {CPU: 1}", trust=Trust.SAFE
    )
    # ray: one task per node; SPREAD or PACK to share nodes (tests)
    placement_strategy: str = field(
        "STRICT_SPREAD", doc="ray: STRICT_SPREAD puts one task on each node", trust=Trust.SAFE
    )
    # tpu-vm
    tpu_name: str | None = field(None, doc="tpu-vm: the TPU VM (slice) name", trust=Trust.ADDRESS)
    # tpu-vm
    zone: str | None = field(None, doc="tpu-vm: its zone", trust=Trust.ADDRESS)
    # tpu-vm; null: gcloud's configured project
    project: str | None = field(None, doc="tpu-vm: its project; empty: gcloud's configured one", trust=Trust.ADDRESS)
    # tpu-vm: the project checkout on every host
    workdir: str = field("~/grpo-pipeline", doc="tpu-vm: the project checkout on every host", trust=Trust.PROGRAM)
    # tpu-vm: its interpreter, relative to workdir (or absolute)
    python: str = field(
        ".venv/bin/python", doc="tpu-vm: the interpreter on every host, relative to workdir", trust=Trust.PROGRAM
    )
    # every process must join within this
    init_timeout_s: int = field(300, doc="Seconds every process has to join the run", ge=1)
    # a process silent this long fails the others
    heartbeat_timeout_s: int = field(100, doc="Seconds a silent process is tolerated before the others fail", ge=1)

    def validate(self) -> None:
        f = self.section_path
        check(
            self.resources_per_host is None
            or (
                isinstance(self.resources_per_host, dict)
                and all(
                    isinstance(k, str) and isinstance(v, (int, float)) and v >= 0
                    for k, v in self.resources_per_host.items()
                )
            ),
            f"{f}.resources_per_host must be a mapping of resource names to amounts like {{TPU: 4}}, "
            f"got {self.resources_per_host!r}",
        )
        check(
            self.placement_strategy in ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"),
            (
                f"{f}.placement_strategy must be STRICT_SPREAD, SPREAD, PACK or STRICT_PACK, got "
                f"{self.placement_strategy!r}"
            ),
        )
        if self.kind is LauncherKind.TPU_VM:
            for name in ("tpu_name", "zone"):
                check(bool(getattr(self, name)), f"{f}.{name} is required with {f}.kind=tpu-vm")

    @property
    def distributed(self) -> bool:
        return self.kind is not LauncherKind.LOCAL

    def single(self) -> "LauncherConfig":
        """For a stage that one process does alone (evaluation, export): here, unless the devices
        are a slice whose hosts must all take part."""
        return self if self.kind in (LauncherKind.RAY, LauncherKind.TPU_VM) else LauncherConfig()
