import os
import uuid

import pytest

from grpo_core.store.root import RunRoot, StorageError, config_hash


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    if request.param == "local":
        return RunRoot(str(tmp_path / "runs" / "r1"))
    return RunRoot(f"memory://test-{uuid.uuid4().hex[:8]}/runs/r1")


def test_objects_round_trip_and_whole_writes(root, tmp_path):
    uri = root.write_json("config.json", {"b": 1, "a": [1, 2]})
    assert uri == root.uri("config.json") and root.read_json("config.json") == {"a": [1, 2], "b": 1}
    root.write_bytes("data/abc/train.bin", b"x" * 10)
    assert root.list("data/abc") == ["train.bin"]  # no temporary names left behind
    assert root.list("nothing") == []
    with pytest.raises(FileNotFoundError, match=r"r1/missing.json does not exist"):
        root.read_json("missing.json")


def test_marker_is_written_last_and_means_done(root):
    stage = "data/0123abcd"
    root.write_bytes(f"{stage}/train.jsonl", b"{}\n")
    assert not root.is_done(stage)  # outputs alone are not a finished stage
    root.mark_done(stage, {"rows": 1})
    assert root.is_done(stage) and root.done_info(stage) == {"rows": 1}


def test_metric_shards_merge_one_row_per_step(root):
    root.write_metrics([{"step": 0, "reward": 0.1}, {"step": 1, "reward": 0.2}])
    root.write_metrics([{"step": 1, "reward": 0.25}, {"step": 2, "reward": 0.3}])  # a retry re-ran step 1
    rows = root.read_metrics()
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["reward"] == 0.25
    assert root.list("metrics") == ["00000000-00000001.jsonl", "00000001-00000002.jsonl"]
    with pytest.raises(ValueError, match="no metric rows"):
        root.write_metrics([])


def test_probe(root):
    root.probe()
    assert [n for n in root.list("") if n.startswith(".probe")] == []


def test_unwritable_root_names_the_url(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    root = RunRoot(str(blocker / "run"))
    with pytest.raises(StorageError, match=f"cannot write {blocker}/run/.probe-"):
        root.probe()
    if os.geteuid() != 0:  # root ignores permissions
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(StorageError, match="cannot write"):
            RunRoot(str(ro / "run")).probe()


def test_config_hash_is_stable_and_order_free():
    a = config_hash({"x": 1, "y": {"b": 2, "a": 1}})
    assert a == config_hash({"y": {"a": 1, "b": 2}, "x": 1}) and len(a) == 12
    assert a != config_hash({"x": 2, "y": {"b": 2, "a": 1}})


def test_storage_errors_that_cannot_fix_themselves_are_not_retried(tmp_path):
    """issue 30: a root under a file, a read-only or full disk, a permission refusal took 3 task
    x 2 flow attempts, each failing the same way; a network failure is still worth a retry."""
    import errno
    import socket

    from grpo_core.errors import ExitCode, classify, is_retryable
    from grpo_core.store.root import check_reachable
    from tasks.stages import can_retry

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(StorageError, match="a path in it is a file, not a folder") as err:
        RunRoot(str(blocker / "run")).write_json("config.json", {})
    failure = classify(err.value)
    assert failure.code == ExitCode.STORAGE_LASTING and not failure.retryable and not is_retryable(failure.code)
    assert not can_retry(err.value)
    for cause in (PermissionError(errno.EACCES, "Permission denied"), OSError(errno.EROFS, "Read-only file system")):
        try:
            raise StorageError("cannot write x") from OSError(errno.ENOSPC, "No space left on device")
        except StorageError as exc:
            assert classify(exc).code == ExitCode.STORAGE_LASTING and not can_retry(exc)
        try:
            raise StorageError("cannot write x") from cause
        except StorageError as exc:
            assert classify(exc).code == ExitCode.STORAGE_LASTING and not can_retry(exc)
    with socket.socket() as s:  # a port nothing listens on: connection refused, worth a retry
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["STORAGE_EMULATOR_HOST"], saved = f"127.0.0.1:{port}", os.environ.get("STORAGE_EMULATOR_HOST")
    try:
        with pytest.raises(StorageError, match="cannot connect") as err:
            check_reachable(f"gs://b-{uuid.uuid4().hex[:6]}/runs", timeout_s=2)
    finally:
        os.environ.pop("STORAGE_EMULATOR_HOST") if saved is None else os.environ.update(STORAGE_EMULATOR_HOST=saved)
    assert classify(err.value).code == ExitCode.STORAGE and can_retry(err.value)
