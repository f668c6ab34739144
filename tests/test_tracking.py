"""pipeline.report_to's trackers with the real parts: TensorBoard event files read back by
TensorBoard's own reader, W&B in offline mode (its run folder), MLflow on a local file store
queried through its client. A resumed run continues the same tracker runs without sending a step
twice; a tracker that fails (a bad key, a server that never answers) is reported once and neither
fails nor stalls the others."""

import glob
import os
import re
import socket

import pytest

from grpo_core.store.root import RunRoot
from grpo_core.store.tracking import Trackers

pytest.importorskip("tensorboard")


@pytest.fixture
def tracker_env(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks file stores to opt in
    (tmp_path / "wandb-dir").mkdir()
    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # W&B reads its settings once per process: each test's environment is its own
    yield tmp_path
    wandb.teardown()


def scalars(run_url: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for path in sorted(glob.glob(os.path.join(run_url, "tensorboard", "events.out.tfevents.*"))):
        acc = EventAccumulator(path)
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out += [(e.step, e.value) for e in acc.Scalars(tag)]
    return out


def _invocation(root: RunRoot, steps, warnings: list, report_to=("tensorboard", "wandb", "mlflow")) -> None:
    t = Trackers(root, report_to, "my-run", "grpo-tests", warn=warnings.append)
    for s in steps:
        t.log(s, {"step": s, "reward": s / 10, "kl": 0.01 * s, "time/step": 0.5, "pass@2": 0.5, "note": "x"})
    t.log(steps[-1] + 1, {"step": steps[-1] + 1, "accuracy": 0.5, "greedy": {"reward_mean": 0.25}}, kind="eval")
    # what was sent is the test, not the run's 30-s bound on closing trackers (a loaded machine can
    # pass it: W&B's offline start is a service process of its own)
    t.close(timeout_s=600)


def test_three_trackers_and_a_resume_that_sends_no_step_twice(tracker_env):
    from mlflow.tracking import MlflowClient

    root = RunRoot(str(tracker_env / "run"))
    warnings: list[str] = []
    _invocation(root, range(0, 5), warnings)
    _invocation(root, range(3, 8), warnings)  # resumed from a checkpoint at 3: steps 3 and 4 again
    assert warnings == []
    state = root.read_json("tracking.json")
    # TensorBoard: each step once, across the two invocations' event files
    assert [s for s, _ in scalars(root.url, "reward")] == list(range(8))
    assert scalars(root.url, "reward")[7][1] == pytest.approx(0.7)
    assert [s for s, _ in scalars(root.url, "eval/accuracy")] == [5, 8]
    assert [s for s, _ in scalars(root.url, "eval/greedy/reward_mean")] == [5, 8]
    # MLflow: one run, the same for both invocations, each step once
    client = MlflowClient()
    history = client.get_metric_history(state["mlflow"]["run_id"], "reward")
    assert sorted(m.step for m in history) == list(range(8))
    assert [m.step for m in client.get_metric_history(state["mlflow"]["run_id"], "pass_at_2")] == list(range(8))
    run = client.get_run(state["mlflow"]["run_id"])
    assert run.info.run_name == "my-run" and run.data.tags["run_uri"] == root.url
    # W&B offline: both invocations wrote the same run id's folders, with the steps in them
    # (offline-run-<time>-<id>, and -<id>-1 when both invocations started in the same second)
    run_id = state["wandb"]["id"]
    ours = re.compile(rf"offline-run-[0-9_]+-{re.escape(run_id)}(-[0-9]+)?")
    folders = [
        f
        for f in glob.glob(str(tracker_env / "wandb-dir" / "wandb" / "offline-run-*"))
        if ours.fullmatch(os.path.basename(f))
    ]
    assert len(folders) == 2, folders
    assert all(glob.glob(os.path.join(f, "*.wandb")) for f in folders)
    assert state["wandb"]["last_step"] == {"train": 7, "eval": 8} == state["tensorboard"]["last_step"]


def test_a_failing_tracker_is_reported_once_and_stalls_nothing(tracker_env, monkeypatch):
    root = RunRoot(str(tracker_env / "run"))
    monkeypatch.setenv("WANDB_MODE", "online")  # no key, no network: a bad key
    monkeypatch.setenv("WANDB_API_KEY", "not-a-key")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: refused
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "5")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    warnings: list[str] = []
    t = Trackers(root, ("tensorboard", "wandb", "mlflow"), "my-run", "grpo-tests", warn=warnings.append)
    for s in range(50):
        t.log(s, {"reward": 1.0})
    t.close(timeout_s=60)
    failed = sorted(w.split(":")[1].split()[0] for w in warnings)
    assert failed == ["mlflow", "wandb"], warnings  # each once, by name
    assert [s for s, _ in scalars(root.url, "reward")] == list(range(50))  # TensorBoard unaffected


def test_logging_never_waits_on_a_tracker(tracker_env, monkeypatch):
    """`log` only queues: with MLflow's server taking the connection and never answering, 50 steps
    are logged while the trackers' thread has taken none of them (no clock in the proof); once the
    server goes away the tracker fails, reported once by name."""
    hole = socket.socket()  # listens, never accepts: a request to it waits until the socket goes
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{hole.getsockname()[1]}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "600")
    warnings: list[str] = []
    t = Trackers(RunRoot(str(tracker_env / "run")), ("mlflow",), "my-run", "grpo-tests", warn=warnings.append)
    try:
        for s in range(50):
            t.log(s, {"reward": 1.0})
        assert t.thread.is_alive() and t.queue.qsize() == 50 and warnings == []
    finally:
        hole.close()  # its waiting connection is reset: MLflow's start fails
    t.close(timeout_s=300)
    assert not t.thread.is_alive() and len(warnings) == 1 and "mlflow failed to start" in warnings[0], warnings


def test_a_tracker_that_is_not_installed_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb: ImportError, as where it is not installed
    warnings: list[str] = []
    _invocation(RunRoot(str(tmp_path / "run")), range(3), warnings, report_to=("wandb",))
    assert len(warnings) == 1 and "grpo-pipeline[tracking]" in warnings[0] and "wandb" in warnings[0]


@pytest.mark.slow  # ~30 s: MLflow creates its SQLite store's tables, W&B starts its service
def test_local_trackers_write_under_the_run_root_not_the_working_directory(tracker_env, monkeypatch):
    """Without the operator's WANDB_DIR or MLFLOW_TRACKING_URI, W&B's files and MLflow's store go
    into the run root ({run}/wandb/, {run}/mlflow.db), not into the folder the process runs in (a
    deployment run's is the serving process's)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("WANDB_DIR")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    cwd = tracker_env / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    root = RunRoot(str(tracker_env / "run"))
    warnings: list[str] = []
    _invocation(root, range(0, 3), warnings, report_to=("wandb", "mlflow"))
    assert warnings == []
    assert sorted(os.listdir(cwd)) == []  # nothing in the working directory
    assert glob.glob(str(tracker_env / "run" / "wandb" / "offline-run-*"))
    state = root.read_json("tracking.json")
    client = MlflowClient(tracking_uri=f"sqlite:///{tracker_env / 'run' / 'mlflow.db'}")
    assert [m.step for m in client.get_metric_history(state["mlflow"]["run_id"], "reward")] == [0, 1, 2]
