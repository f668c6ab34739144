"""grpo_core: GRPO in JAX + Flax NNX + Optax. Never imports Prefect."""

import glob as _glob
import os as _os
from importlib import metadata as _metadata
from importlib.util import find_spec as _find_spec


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


# TPU chips are PCI devices of Google's with these ids (jax._src.hardware_utils' table: v3, v4,
# v5p, v5e, v6e, 7x; Google's other devices, such as a GCE VM's gVNIC, are not TPUs)
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")
_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin")


def tpu_chips_here() -> int:
    """The TPU chips on this host's PCI bus, which a JAX process could open (0 off TPU VMs)."""
    count = 0
    for vendor in _glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as v, open(_os.path.join(_os.path.dirname(vendor), "device")) as d:
                count += v.read().strip() == _GOOGLE_PCI_VENDOR and d.read().strip() in _TPU_PCI_DEVICES
        except OSError:
            continue
    return count


def cpu_unless_tpu() -> str | None:
    """Before JAX is imported in a worker: where libtpu is installed (the dev install brings it
    for AOT checks) but this host has no TPU and no GPU plugin, run on the CPU backend alone
    (JAX_PLATFORMS=cpu). Otherwise JAX loads libtpu at its first array, which takes
    /tmp/libtpu_lockfile for the process's whole life (another process's readiness check then
    reports "the TPU is in use") and prints its failed TPU probe. A JAX_PLATFORMS the user set
    wins. Returns the value set, or None."""
    if "JAX_PLATFORMS" in _os.environ or _find_spec("libtpu") is None:
        return None
    if tpu_chips_here() or any(_find_spec(p) is not None for p in _GPU_PLUGINS):
        return None
    _os.environ["JAX_PLATFORMS"] = "cpu"
    return "cpu"


# Set before any JAX import in every process of the project (grpo_core is imported first). Kept in
# this file, which imports no other module of the project (tests/test_errors.py holds that).
cpu_unless_tpu()

# transformers says "PyTorch was not found. Models won't be available..." on import where PyTorch is
# not installed (`make demo`'s environment): this project loads only its tokenizers and configs with
# it, so the advice is noise in every command's output (issue 65). A user's own setting wins.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
