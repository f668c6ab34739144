"""Run test code in a child process with N CPU devices: XLA_FLAGS must be set before JAX starts,
so a test that needs a mesh of several devices runs its part there."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The tests' XLA:CPU flag for programs that compile more than they compute (tests/conftest.py sets it)
FAST_COMPILE = "--xla_backend_optimization_level=0"


def optimized_flags() -> str:
    """This process's XLA_FLAGS without FAST_COMPILE: for a child process that computes more than
    it compiles, which then runs as a user's run does."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f != FAST_COMPILE)


def run_with_devices(devices: int, code: str, timeout_s: float = 300, optimized: bool = False) -> None:
    """`python -c code` from the repository root with `devices` CPU devices; fails the test with
    the child's stderr when it exits non-zero. The child keeps the tests' XLA flags but the device
    count; `optimized` drops FAST_COMPILE too (code that computes for long)."""
    base = optimized_flags() if optimized else os.environ.get("XLA_FLAGS", "")
    flags = [f for f in base.split() if not f.startswith("--xla_force_host_platform_device_count=")]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
