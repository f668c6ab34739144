"""Experiment trackers the training metrics also go to (pipeline.report_to, as TRL's report_to):
TensorBoard event files in the run root ({run}/tensorboard/, so `tensorboard --logdir` on the run
folder, local or gs://, shows them), Weights & Biases and MLflow. A tracker that keeps local files
keeps them in the run root ({run}/wandb/, {run}/mlflow.db) unless the operator's environment says
otherwise (WANDB_DIR, MLFLOW_TRACKING_URI); where it sends is the trust policy's (an address).

The metric names are the run's own (reward, kl, entropy, time/step, ...; evaluation as eval/*).
A resumed run continues the same tracker run: {run}/tracking.json holds each tracker's run id and
the last step it was given, and a step at or before it is not sent again (a worker that resumes
from its checkpoint re-runs the steps after it). A tracker that fails (no network, a bad key, not
installed) is reported once and dropped; calls go through one background thread, so a tracker
that hangs never stalls training, and closing waits a bounded time.
"""

from __future__ import annotations

import io
import math
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
import uuid
from typing import Any, Callable

from grpo_core.store.root import RunRoot

STATE = "tracking.json"


def _numbers(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of `metrics`, one level of nesting as name/key (eval's greedy/*)."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, dict) and not prefix:
            out.update(_numbers(v, f"{k}/"))
        elif (
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k not in ("step", "epoch")
        ):
            out[prefix + k] = float(v)
    return out


class _TensorBoard:
    """Event files written with TensorBoard's own record format and protos. Each invocation has
    its own file, rewritten whole at each flush (an object store has no append)."""

    def __init__(self, root: RunRoot, state: dict[str, Any], name: str, project: str):
        # the trackers are optional extras (tensorboard, wandb, mlflow): imported only when named
        from tensorboard.compat.proto import event_pb2  # noqa: F401 - fails here when not installed

        self.root = root
        self.rel = f"tensorboard/events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{uuid.uuid4().hex[:8]}"
        self.buffer = io.BytesIO()
        self._record(self._event(file_version="brain.Event:2"))

    @staticmethod
    def _event(step: int = 0, **fields: Any):
        from tensorboard.compat.proto import event_pb2  # optional: the tensorboard extra

        return event_pb2.Event(wall_time=time.time(), step=step, **fields)

    def _record(self, event) -> None:
        from tensorboard.summary.writer.record_writer import RecordWriter  # optional, as above

        RecordWriter(self.buffer).write(event.SerializeToString())

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from tensorboard.compat.proto import summary_pb2  # optional, as above

        values = [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        self._record(self._event(step=step, summary=summary_pb2.Summary(value=values)))

    def flush(self) -> None:
        self.root.write_bytes(self.rel, self.buffer.getvalue())

    def close(self) -> None:
        self.flush()


class _WandB:
    def __init__(self, root: RunRoot, state: dict[str, Any], name: str, project: str):
        import wandb  # optional, as tensorboard

        state.setdefault("id", uuid.uuid4().hex[:12])  # a W&B run id: the same run on every resume
        # W&B keeps its files (and, offline, the whole run) in a folder: WANDB_DIR where the
        # operator set it, else the run root when that is a local folder, else a temporary one,
        # never the working directory of the process (the serving process's, for a deployment)
        local = not os.environ.get("WANDB_DIR") and not root.is_local
        self.tmp = tempfile.mkdtemp(prefix="grpo-wandb-") if local else None
        where = None if os.environ.get("WANDB_DIR") else (root.path if root.is_local else self.tmp)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", project),
            name=name,
            id=state["id"],
            resume="allow",
            config={"run_uri": root.url},
            reinit="create_new",
            dir=where,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


class _MLflow:
    def __init__(self, root: RunRoot, state: dict[str, Any], name: str, project: str):
        from mlflow.tracking import MlflowClient  # optional, as tensorboard

        # MLFLOW_TRACKING_URI where the operator set it; else a store in the run root when that is
        # a local folder (the trust policy refuses a deployment run whose root is not); else
        # MLflow's own default, in the working directory, for the local user's run
        store = None
        if not os.environ.get("MLFLOW_TRACKING_URI") and root.is_local:
            store = f"sqlite:///{os.path.join(root.path, 'mlflow.db')}"
        self.client = MlflowClient(tracking_uri=store)
        if "run_id" not in state:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", project)
            found = self.client.get_experiment_by_name(experiment)
            exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
            state["run_id"] = self.client.create_run(exp_id, run_name=name, tags={"run_uri": root.url}).info.run_id
        self.run_id = state["run_id"]

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric  # optional, as tensorboard

        now = int(time.time() * 1000)
        # MLflow keys take letters, digits and _ - . / space only
        batch = [Metric(k.replace("@", "_at_"), v, now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


_KINDS = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}


class Trackers:
    """The trackers of one invocation of a run. `log` only queues: a background thread calls the
    trackers. `warn` reports a tracker's failure (once per tracker)."""

    def __init__(
        self,
        root: RunRoot,
        report_to: tuple[str, ...],
        name: str,
        project: str,
        warn: Callable[[str], None],
        flush_every_s: float = 10.0,
    ):
        self.root, self.names, self.run_name, self.project, self.warn = root, tuple(report_to), name, project, warn
        self.flush_every_s = flush_every_s
        self.state: dict[str, Any] = {}
        self.live: dict[str, Any] = {}
        self.queue: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        if self.names:
            self.thread = threading.Thread(target=self._loop, name="trackers", daemon=True)
            self.thread.start()

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        """Queue one step's metrics; `kind` "eval" prefixes them eval/ (its steps are checkpoints)."""
        if self.thread is not None:
            numbers = _numbers(metrics)
            if kind != "train":
                numbers = {f"{kind}/{k}": v for k, v in numbers.items()}
            self.queue.put((kind, int(step), numbers))

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush and close the trackers, waiting at most `timeout_s` (then leave them behind)."""
        if self.thread is None:
            return
        self.queue.put(("close", 0, {}))
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            self.warn(f"experiment trackers did not finish within {timeout_s:.0f} s; left behind")

    # -- the background thread ------------------------------------------------------------

    def _fail(self, name: str, what: str, exc: BaseException) -> None:
        self.live.pop(name, None)
        hint = " (pip install 'grpo-pipeline[tracking]')" if isinstance(exc, ImportError) else ""
        self.warn(f"pipeline.report_to: {name} failed to {what} ({type(exc).__name__}: {exc}){hint}; training goes on")

    def _start(self) -> None:
        try:
            self.state = self.root.read_json(STATE) if self.root.exists(STATE) else {}
        except Exception:  # noqa: BLE001 - an unreadable state only means starting new tracker runs
            self.state = {}
        for name in self.names:
            mine = self.state.setdefault(name, {})
            try:
                self.live[name] = _KINDS[name](self.root, mine, self.run_name, self.project)
            except Exception as exc:  # noqa: BLE001 - any failure: reported, training goes on
                self._fail(name, "start", exc)

    def _save(self) -> None:
        try:
            self.root.write_json(STATE, self.state)
        except Exception as exc:  # noqa: BLE001
            self.warn(f"pipeline.report_to: could not write {STATE} ({exc}); a resume may send steps again")

    def _each(self, what: str, call: Callable[[str, Any], None]) -> None:
        for name, tracker in list(self.live.items()):
            try:
                call(name, tracker)
            except Exception as exc:  # noqa: BLE001
                self._fail(name, what, exc)

    def _loop(self) -> None:
        self._start()
        last_flush = time.monotonic()
        while True:
            try:
                kind, step, metrics = self.queue.get(timeout=self.flush_every_s)
            except queue.Empty:
                kind, step, metrics = "tick", 0, {}
            if kind not in ("tick", "close") and metrics:

                def send(name: str, tracker: Any) -> None:
                    last = self.state[name].setdefault("last_step", {})
                    if step > last.get(kind, -1):  # a resumed worker re-runs steps already sent
                        tracker.log(step, metrics)
                        last[kind] = step

                self._each("log", send)
            if kind == "close" or time.monotonic() - last_flush >= self.flush_every_s:
                self._each("flush", lambda _, t: t.flush())
                self._save()
                last_flush = time.monotonic()
            if kind == "close":
                self._each("close", lambda _, t: t.close())
                return
