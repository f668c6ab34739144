"""Run test code in a child process with N CPU devices: XLA_FLAGS must be set before JAX starts,
so a test that needs a mesh of several devices runs its part there."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_with_devices(devices: int, code: str, timeout_s: float = 300) -> None:
    """`python -c code` from the repository root with `devices` CPU devices; fails the test with
    the child's stderr when it exits non-zero."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
