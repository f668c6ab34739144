from flows.cli import main


def test_train_command_runs_and_reports(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    rc = main(["train", "--set", "train.num_steps=3", "--set", "eval_rows=8", "--metrics", str(metrics)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "greedy accuracy on held-out prompts" in out and "training reward" in out
    assert len(metrics.read_text().splitlines()) == 3


def test_config_error_exits_2_and_names_the_field(capsys):
    assert main(["train", "--set", "train.grpo.num_generations=1"]) == 2
    assert "grpo.num_generations must be >= 2, got 1" in capsys.readouterr().err


def test_yaml_config_file(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("eval_rows: 4\ntrain:\n  num_steps: 2\n  grpo:\n    beta: 0.04\n")
    assert main(["train", "--config", str(f), "--print-every", "1"]) == 0
    assert "2 steps of 16 prompts" in capsys.readouterr().out
