"""grpo_core: GRPO in JAX + Flax NNX + Optax. Never imports Prefect."""

import os as _os
from importlib import metadata as _metadata


def _cpu_compile_defaults() -> None:
    """Turn off XLA:CPU's fusion emitters unless the user set that flag or opts out.

    Measured with bench/grpo_step.py on jaxlib 0.10: they make compilation ~30% slower (the
    small workload's cold first step 11.3 s -> 8.0 s without them) for no gain in step time.
    XLA reads XLA_FLAGS when its CPU client starts, i.e. at the first computation, so this must
    run before any; it only concerns the CPU backend. Applied to the jaxlib versions it was
    measured on, since XLA aborts on flags it does not know. Opt out: GRPO_CPU_XLA_DEFAULTS=0.
    """
    if _os.environ.get("GRPO_CPU_XLA_DEFAULTS", "1") == "0":
        return
    try:
        major, minor = (int(x) for x in _metadata.version("jaxlib").split(".")[:2])
    except (_metadata.PackageNotFoundError, ValueError):
        return
    flags = _os.environ.get("XLA_FLAGS", "")
    if (major, minor) == (0, 10) and "xla_cpu_use_fusion_emitters" not in flags:
        _os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_use_fusion_emitters=false".strip()


_cpu_compile_defaults()


def _cpu_unless_tpu() -> None:
    """Where libtpu is installed (the dev install brings it, for AOT checks of a TPU target) but
    this host has no TPU, JAX must not load it: see grpo_core.launch.processes.cpu_unless_tpu."""
    from grpo_core.launch.processes import cpu_unless_tpu

    cpu_unless_tpu()


_cpu_unless_tpu()
