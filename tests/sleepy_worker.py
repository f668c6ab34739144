"""A stand-in worker for tests/test_tasks.py: it starts a child, reports both pids as an event,
then sleeps (or exits with the code given), so a test can check that a time limit stops the
whole process group."""

import json
import os
import signal
import subprocess
import sys
import time

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode.startswith("exit="):
        print(json.dumps({"event": "error", "kind": "config", "message": "bad field x"}), flush=True)
        sys.exit(int(mode[5:]))
    if mode == "kill9":  # a warning on stderr, then killed: the warning is not the cause
        print("WARNING:absl:Waiting for previous save to finish", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("not an event", flush=True)
    print(json.dumps({"event": "start", "pid": child.pid}), flush=True)
    time.sleep(600)
