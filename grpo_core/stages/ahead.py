"""A stage's worker started ahead of its stage, while the stage before it still runs.

    python -m grpo_core.stages.ahead      # then one JSON line on stdin: {"argv": [worker arguments]}

A local worker spends about a second of every stage importing JAX, flax, Orbax and the trainer
before it reads its run. This process does that while the previous stage trains, then waits for
its command line on stdin and runs it as `python -m grpo_core.stages.worker ARGS` would, in the
environment it was started with (the launcher hands it over only when that environment is the
one the stage's worker would get: grpo_core.launch.launchers.start). Nothing touches a device
before the command comes: JAX starts its backend, and takes a TPU, at the first array. End of
stdin (the pipeline ended, or its next stage needed another process) ends it at once.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    from grpo_core.stages import worker  # the point of this process: the worker's imports, ahead

    worker.preload()
    line = sys.stdin.readline()
    if not line.strip():
        os._exit(0)  # no stage came for it
    argv = json.loads(line)["argv"]
    sys.argv = [worker.__file__, *argv]
    worker.run_process(argv)


if __name__ == "__main__":
    main()
