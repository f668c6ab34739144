"""Fault injection for the tests that prove a killed worker resumes: the worker loads this file
by path through its test hook (grpo_core.stages.worker._test_hook), so a test sets both

    GRPO_TEST_HOOK=HOOK  (below)
    GRPO_FAULT="where:step:flagfile[,...]"

and the worker SIGKILLs itself after that step ('step') or once its checkpoint is durable
('checkpoint'), or SIGKILLs its split layout's rollout process after that step ('rollout'). Each
fault fires once: its flag file records that it did, so the retried worker runs through.
GRPO_FAULT_RUN limits it to runs whose root URL contains that text, GRPO_FAULT_PROCESS to one
process of a multi-host run.

Loaded outside the tests package (the worker's sys.path need not reach it): imports nothing
from tests.
"""

import os
import signal
import sys

HOOK = f"{os.path.abspath(__file__)}:fault"


def fault(point: str, *, step: int, root_url: str, rollout_pid: int | None = None, **_) -> None:
    if os.environ.get("GRPO_FAULT_RUN", "") not in root_url:
        return
    only = os.environ.get("GRPO_FAULT_PROCESS")
    if only is not None and int(only) != _process_index():
        return
    for spec in filter(None, os.environ.get("GRPO_FAULT", "").split(",")):
        w, s, flag = spec.split(":", 2)
        if w == "rollout" and point == "step" and int(s) == step and rollout_pid and not os.path.exists(flag):
            open(flag, "w").close()
            os.kill(rollout_pid, signal.SIGKILL)
        elif w == point and int(s) == step and not os.path.exists(flag):
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def _process_index() -> int:
    if "jax" not in sys.modules:  # a single process that has not started JAX yet
        return 0
    import jax

    return jax.process_index()
