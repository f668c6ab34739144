"""The `grpo` command line: config errors, readiness, status and eval of a run folder."""

import json

import pytest

from flows.cli import main


def test_config_error_exits_2_and_names_the_field(capsys):
    assert main(["run", "--set", "train.grpo.num_generations=1"]) == 2
    assert "grpo.num_generations must be >= 2, got 1" in capsys.readouterr().err


def test_unknown_section_and_bad_yaml(tmp_path, capsys):
    assert main(["run", "--set", "trian.num_steps=3"]) == 2
    assert "unknown config section(s) ['trian']" in capsys.readouterr().err
    f = tmp_path / "run.yaml"
    f.write_text("train: [1, 2\n")
    assert main(["check", "--config", str(f)]) == 2
    assert f"config file {f} is not valid YAML" in capsys.readouterr().err


def test_check_prints_the_report(tmp_path, capsys):
    assert main(["check", "--json", "--set", f"storage.root={tmp_path}"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ready"] is True and report["backend"] == "cpu"
    assert {c["name"] for c in report["checks"]} >= {"storage", "backend", "memory"}
    assert main(["check", "--set", f"storage.root={tmp_path}", "--set", "pipeline.require_tpu=true"]) == 4
    out = capsys.readouterr().out
    assert "NOT READY" in out and "fix:" in out


def test_status_of_a_missing_run(tmp_path, capsys):
    assert main(["status", str(tmp_path / "nope")]) == 2
    assert "is not a run: it has no config.json" in capsys.readouterr().err


@pytest.mark.slow
def test_status_and_eval_of_a_run_folder(tmp_path, capsys):
    from tests.test_worker import events, make_run, worker

    run = make_run(str(tmp_path), "r")
    events(worker(run, 2))
    assert main(["eval", run, "--step", "0", "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "step      0: accuracy" in out and "step      2: accuracy" in out
    assert main(["status", run, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["steps_done"] == 2 and st["latest_checkpoint"] == 2 and [e["step"] for e in st["eval"]] == [0, 2]
    assert main(["eval", run, "--step", "5"]) == 2
    assert "no checkpoint for step 5" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["status", "export", "eval"])
@pytest.mark.parametrize("run", ["..", "../../etc", "/"])
def test_a_path_that_is_no_run_is_refused_before_any_worker(command, run, tmp_path, monkeypatch, capsys):
    """issue 28: `grpo export ../../etc` resolved to a folder outside any run and started a worker there."""
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    assert main([command, run, *(["--step", "0"] if command == "eval" else [])]) == 2
    assert "is not a run: it has no config.json" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b"]  # nothing written anywhere


@pytest.mark.parametrize("name", ["a\\b", "x\\..\\y"])
def test_a_run_name_that_is_no_folder_name_is_refused(name, capsys):
    # RUN without a separator is a run_name under storage.root, refused naming the field
    assert main(["export", name]) == 2
    assert f"run_name must be a single folder name, got {name!r}: it holds a path separator" in capsys.readouterr().err


def test_a_gs_source_out_of_reach_is_one_line_not_a_traceback(monkeypatch, capsys):
    """issue 28: a gs:// data source without network printed a 34-line uncaught traceback."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:1")  # nothing listens there: refused
    assert main(["check", "--set", "data.source=gs://grpo-bucket/no-network.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("storage error: data.source gs://grpo-bucket/no-network.jsonl: cannot reach")
    assert "Traceback" not in err and len(err.splitlines()) == 1
