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
    assert main(["status", run]) == 0
    out = capsys.readouterr().out
    assert "steps 2/6, latest checkpoint 2" in out and "last step: step 2  reward" in out  # one count (issue 53)
    # evaluated already: another eval setting is refused, not answered with the stored result (issue 53)
    assert main(["eval", run, "--step", "2", "--set", "data.eval_rows=4"]) == 2
    assert "--set would change it: data.eval_rows: 8 -> 4" in capsys.readouterr().err
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


# -- one truth in the CLI (issue 53, item 6) -------------------------------------------------------


def test_eval_and_export_refuse_a_set_that_would_change_the_run(tmp_path, capsys):
    """(a) `grpo eval RUN --step 4 --set data.eval_rows=16` read the stored result back: the worker
    evaluates the run as its config.json says. A --set that changes that is refused, before any
    worker; one that only says where the run is, or repeats the run's own value, is not."""
    from grpo_core.errors import ConfigError
    from grpo_core.store.root import RunRoot
    from grpo_core.store.runs import check_overrides
    from tests.test_worker import make_run

    run = make_run(str(tmp_path), "r")
    for command in (["eval", run, "--step", "0"], ["export", run]):
        assert main([*command, "--set", "data.eval_rows=16", "--set", "eval.temperature=0.5"]) == 2
        err = capsys.readouterr().err
        assert f"error: grpo {command[0]} works on the run as its config.json says ({run}/config.json)" in err
        assert "data.eval_rows: 8 -> 16; eval.temperature: 1.0 -> 0.5" in err
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["config.json", "data"]  # no worker ran
    root = RunRoot(run)
    check_overrides(root, [f"storage.root={tmp_path}", "run_name=r", "data.eval_rows=8", "eval.num_samples=2"], "x")
    with pytest.raises(ConfigError, match=r"--set would change it: rewards: .*'char_match'.* -> .*'math_answer'"):
        check_overrides(root, ["rewards=[math_answer]"], "grpo eval")


def test_status_counts_its_last_step_as_it_counts_the_steps_done(tmp_path, capsys):
    """(b) `grpo status` printed "steps 4/4" beside "last step: step 3": the metrics files number
    steps from 0, checkpoints, evaluations and steps_done count them."""
    from grpo_core.store.root import RunRoot
    from tests.test_worker import make_run

    run = make_run(str(tmp_path), "r")  # num_steps 6
    RunRoot(run).write_metrics([{"step": float(s), "reward": 0.25 * s, "kl": 0.0} for s in range(4)])
    assert main(["status", run]) == 0
    out = capsys.readouterr().out
    assert "  steps 4/6, latest checkpoint None" in out and "  last step: step 4  reward 0.75  kl 0" in out
    assert main(["status", run, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["steps_done"] == st["last_metrics"]["step"] == 4


def test_status_and_the_summary_name_missing_metrics_and_why_a_run_failed(tmp_path, capsys):
    """(issue 65, items 1 and 10) A run root whose first metric rows are gone (a wiped bucket, then
    a resume) said "completed" with no word of them; a failed run said only "failed"."""
    from grpo_core.store.report import build_summary, metric_gaps
    from grpo_core.store.root import RunRoot
    from tests.test_worker import make_run

    assert metric_gaps([3, 4, 7], 10) == ["0-2", "5-6", "8-9"] and metric_gaps(list(range(4)), 4) == []
    run = make_run(str(tmp_path), "r")
    root = RunRoot(run)
    root.write_metrics([{"step": float(s), "reward": 0.5} for s in range(3, 6)])
    summary = build_summary(root, "completed")
    assert summary["metrics_missing"] == ["0-2"] and summary["steps"] == 6
    root.write_json("summary.json", build_summary(root, "failed", error="DataError: row 3 has no column 'prompt'"))
    assert main(["status", run]) == 0
    out = capsys.readouterr().out
    assert "failed\n  why: DataError: row 3 has no column 'prompt'\n" in out
    assert "  metrics missing for steps 0-2 (the checkpoints hold those steps)" in out


def test_the_printed_time_is_summary_jsons_or_says_what_it_measures(tmp_path, capsys):
    """(c) the CLI printed "354 s" where summary.json said 340.35: the flow's time is printed as
    summary.json holds it, the command's (the Prefect server's start and stop besides) named apart."""
    from flows.cli import _print_summary
    from grpo_core.store.report import build_summary
    from grpo_core.store.root import RunRoot
    from tests.test_worker import make_run

    run = make_run(str(tmp_path), "r")
    RunRoot(run).write_metrics([{"step": float(s), "reward": 0.5} for s in range(4)])
    s = build_summary(RunRoot(run), "completed", timing={"wall_s": 340.35})  # as the flow's summarize writes it
    _print_summary(dict(s, last_invocation={"wall_s": 340.35, "did_work": True}), 354.2049)
    out = capsys.readouterr().out
    assert f"run completed: {run}  (4 steps)\n" in out
    assert (
        "time: the flow 340.35 s (summary.json last_invocation.wall_s), the command 354.20 s "
        "(with the local Prefect server's start and stop)" in out
    )
    # resumed: this invocation's flow, and the run's invocations together as timing.wall_s holds them
    _print_summary(dict(s, last_invocation={"wall_s": 12.5, "did_work": True}), 25.0)
    assert "the flow 12.50 s (summary.json last_invocation.wall_s; the run's invocations together 340.35 s, " in (
        capsys.readouterr().out
    )


def test_a_failed_run_exits_with_the_code_that_says_why():
    """(issue 65 item 8) `grpo run` exited 1 for every failure, where docs/concepts.md lists a code
    for each kind: the failing stage's (the worker's, the readiness check's 4), the table's for an
    exception the flow raised, 1 for the rest."""
    from flows.cli import exit_code
    from grpo_core.errors import ConfigError, DataError, ExitCode, StorageError
    from tasks.process import StageError

    assert exit_code(StageError("reward", retryable=False, code=ExitCode.REWARD)) == 3
    assert exit_code(StageError("not ready", retryable=False, code=ExitCode.NOT_READY)) == 4
    assert exit_code(StageError("killed", retryable=True)) == 1
    assert exit_code(ConfigError("x")) == 2 and exit_code(DataError("x")) == 2
    assert exit_code(StorageError("x")) == 5 and exit_code(RuntimeError("x")) == 1


def test_the_printed_loader_runs_without_pytorch(tmp_path):
    """(issue 65 item 2) The demo printed `transformers.AutoModelForCausalLM.from_pretrained` for its
    export, which `make demo`'s environment cannot run (no PyTorch). It prints `grpo generate FOLDER
    PROMPT`, the project's own JAX loader and sampler, which runs with PyTorch made unimportable."""
    import subprocess
    import sys

    from grpo_core.nn.tiny_hf import write_tiny_model

    folder = write_tiny_model(tmp_path / "m")
    code = (
        "import runpy, sys; sys.modules['torch'] = None; "  # `import torch` now raises ImportError
        "sys.argv = ['generate', sys.argv[1], '--max-new-tokens', '3', 'What is 2+3?', 'Hi']; "
        "runpy.run_module('grpo_core.stages.generate', run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("'What is 2+3?' -> '") and lines[1].startswith("'Hi' -> '")
    assert main(["generate", str(tmp_path / "nowhere"), "x"]) == 2  # a folder that is no model: said, exit 2


def test_run_plot_in_a_script_is_the_pngs_bytes(tmp_path):
    """(issue 65 item 5) Run.plot() returned an IPython Image wherever IPython was installed; its
    docstring says the PNG's bytes outside IPython, which a script (no kernel) now gets."""
    from flows.results import Run
    from grpo_core.store.root import RunRoot

    RunRoot(str(tmp_path / "r")).write_metrics([{"step": float(s), "reward": 0.1 * s} for s in range(5)])
    png = Run(str(tmp_path / "r")).plot()
    assert isinstance(png, bytes) and png[:8] == b"\x89PNG\r\n\x1a\n"
