"""A stage's worker started ahead of its stage, while the stage before it still runs.

    python -m grpo_core.stages.ahead      # then one JSON line on stdin: {"argv": [worker arguments]}

A local worker spends about a second of every stage importing JAX, flax, Orbax and the trainer
before it reads its run. This process does that while the previous stage trains, then waits for
its command line on stdin and runs it as `python -m grpo_core.stages.worker ARGS` would, in the
environment it was started with (the launcher hands it over only when that environment is the
one the stage's worker would get: grpo_core.launch.launchers.start). Nothing touches a device
before the command comes: JAX starts its backend, and takes a TPU, at the first array. End of
stdin (the pipeline ended, or its next stage needed another process) ends it at once.

The pipeline's readiness stage starts the first training worker this way too, with the device
checks as a first line, {"readiness": request} (grpo_core.stages.readiness): the process prints
{"event": "report", "report": ...} and, when ready, waits for its stage with its backend up and
the devices it checked already its own; not ready, it ends. One process start, one JAX start and
one TPU opening fewer per run than a check process of its own.

A stage that another worker stage follows (an epoch before the last) is handed its command line
with "stay": true. The process then stays for the next stage instead of exiting: once the stage
ended well it prints {"event": "stage_end"} and waits for the next line, which runs
in it with JAX started, the compiled programs in memory and the chip still its own. The stage
itself runs as a fresh worker would run it (read the run root, restore the newest checkpoint),
so a stage in a process that stayed ends exactly as one in a new process. A stage that failed,
or was asked to stop, ends the process with its exit code, as always.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile
from typing import Iterator


def _message() -> dict | None:
    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else None


@contextlib.contextmanager
def stderr_aside(keep_tail: int = 4000) -> Iterator[None]:
    """This process's stderr (fd 2: Python, XLA and libtpu alike) goes to a file meanwhile: nothing
    reads its pipe until a stage takes the process, and a backend's start-up logs that filled the
    pipe would stall it before its report. On an exception the file's tail is written back, so a
    check that crashed still says why."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        except BaseException:
            sys.stderr.flush()
            f.seek(max(0, f.seek(0, os.SEEK_END) - keep_tail))
            os.write(saved, f.read())
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def main() -> None:
    from grpo_core.stages import worker  # the point of this process: the worker's imports, ahead

    worker.preload()
    message = _message()
    if message is not None and "readiness" in message:
        from grpo_core.stages import readiness  # worker start: with the worker's imports

        with stderr_aside():
            report, _ = readiness.answer(message["readiness"])
        print(json.dumps({"event": "report", "report": report}), flush=True)
        message = _message() if report["ready"] else None
    while message is not None:
        argv = message["argv"]
        sys.argv = [worker.__file__, *argv]
        if not message.get("stay"):
            worker.run_process(argv)  # the last stage of this process: it ends there
        code = worker.main(argv)
        if code or worker.stop_requested():
            worker.end_process(code)
        gc.collect()  # the stage's trainer and arrays: freed before the next one builds its own
        print(json.dumps({"event": "stage_end"}), flush=True)
        message = _message()
    os._exit(0)  # no (further) stage came for it


if __name__ == "__main__":
    main()
