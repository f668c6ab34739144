"""A damaged file in a run root (issue 28, item 4): a JSON file or a metrics shard cut short by a
crash mid-write on a filesystem without atomic renames, or by a partial upload. Readers use what
is whole and name what is not; nothing shows a raw JSONDecodeError or a traceback."""

import logging

import pytest

from flows.cli import main
from grpo_core.config.run import RunConfig
from grpo_core.errors import ConfigError, DamagedFile
from grpo_core.store.root import RunRoot
from grpo_core.store.runs import init_run_root


def _run(tmp_path, name="r") -> RunRoot:
    root = init_run_root(RunConfig.from_dict({"run_name": name, "storage": {"root": str(tmp_path)}}))
    root.write_metrics([{"step": s, "reward": 0.5 + s, "kl": 0.0} for s in range(3)])
    root.write_metrics([{"step": s, "reward": 0.5 + s, "kl": None} for s in range(3, 6)])
    return root


def _cut(path, keep: int = 7) -> None:
    """Cut the file's last line `keep` bytes into it, as a write cut short leaves it."""
    data = path.read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[: start + keep])


def test_a_cut_metrics_shard_keeps_its_complete_rows_and_names_the_file(tmp_path, caplog):
    root = _run(tmp_path)
    shard = tmp_path / "r" / "metrics" / "00000003-00000005.jsonl"
    _cut(shard)
    with caplog.at_level(logging.WARNING, logger="grpo_core.store.root"):
        rows = root.read_metrics()
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # step 5's row was the cut one
    [warning] = [r.getMessage() for r in caplog.records]
    assert str(shard) in warning and "line 3 of 3 is damaged" in warning and "cut short" in warning


def test_a_damaged_line_inside_a_shard_is_left_out_too(tmp_path, caplog):
    root = _run(tmp_path)
    shard = tmp_path / "r" / "metrics" / "00000000-00000002.jsonl"
    lines = shard.read_text().splitlines()
    shard.write_text("\n".join([lines[0], lines[1][:5], lines[2]]) + "\n")
    assert [r["step"] for r in root.read_metrics()] == [0, 2, 3, 4, 5]
    assert "line 2 of 3 is damaged" in caplog.text and "cut short" not in caplog.text


@pytest.mark.parametrize("name", ["config.json", "summary.json", "stages/x/_SUCCESS.json"])
def test_a_json_file_that_does_not_parse_is_named(tmp_path, name):
    root = _run(tmp_path)
    root.write_json(name, {"status": "completed", "steps": 6})
    path = tmp_path / "r" / name
    path.write_bytes(path.read_bytes()[:-9])
    with pytest.raises(DamagedFile) as err:
        root.read_json(name)
    assert isinstance(err.value, ConfigError)  # not retried: the same bytes fail the same way
    msg = str(err.value)
    assert msg.startswith(f"{path} is damaged: not valid JSON (") and "restore it, or delete it" in msg


def test_status_reports_a_cut_shard_and_never_a_traceback(tmp_path, capsys):
    root = _run(tmp_path)
    _cut(tmp_path / "r" / "metrics" / "00000003-00000005.jsonl")
    assert main(["status", root.url]) == 0
    out, err = capsys.readouterr()
    assert "steps 5/" in out and "00000003-00000005.jsonl: line 3 of 3 is damaged" in err
    summary = tmp_path / "r" / "summary.json"
    summary.write_text('{"status": "compl')
    assert main(["status", root.url]) == 2
    out, err = capsys.readouterr()
    assert f"error: {summary} is damaged: not valid JSON" in err and "Traceback" not in out + err
    (tmp_path / "r" / "config.json").write_text("[1, 2]")  # JSON, but no config
    assert main(["status", root.url]) == 2
    assert "config.json is not a run's config" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_a_cut_config_json_fails_the_flow_once_naming_the_file(tmp_path):
    """Before: a raw JSONDecodeError without the file's name, and the flow ran twice."""
    from flows.pipeline import grpo_pipeline
    from tests.test_flow_retries import _flow_run_count
    from tests.test_pipeline import small_config

    cfg = small_config(str(tmp_path), "cut", pipeline={"flow_retries": 1})  # the config's budget is the run's
    init_run_root(RunConfig.from_dict(cfg))
    config = tmp_path / "cut" / "config.json"
    config.write_bytes(config.read_bytes()[:100])
    state = grpo_pipeline.with_options(retries=1, retry_delay_seconds=0)(cfg, return_state=True)
    assert state.is_failed() and _flow_run_count(state) == 1
    assert f"{config} is damaged: not valid JSON" in state.message


def test_a_read_only_local_folder_is_not_talked_about_as_a_bucket(tmp_path):
    """issue 28 (D1): the message for a local folder that refuses writes spoke of buckets and credentials."""
    from grpo_core.store.root import describe_storage_error

    err = PermissionError(13, "Permission denied", str(tmp_path / "r" / "config.json"))
    local = describe_storage_error(str(tmp_path), err)
    assert local.startswith(f"storage.root {tmp_path}: permission denied; make the folder writable by this user")
    assert "bucket" not in local and "credentials" not in local.lower()
    assert "GOOGLE_APPLICATION_CREDENTIALS" in describe_storage_error("gs://b/runs", err)
