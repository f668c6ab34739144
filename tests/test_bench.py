"""The load and generation benchmarks, once each on the tiny model: the table and the JSON have
one row per engine (and format or batch size) with positive numbers. Each spawns fresh Python
processes (jax, torch), hence `slow`."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


def test_hf_load_benchmark(tmp_path, capsys):
    from bench import hf_load

    assert (
        hf_load.main(
            ["--workload", "tiny", "--format", "sharded", "--repeats", "1", "--json", str(tmp_path / "out.json")]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "tiny sharded: ours ready in" in table and "tiny: save_hf_model" in table
    out = json.load(open(tmp_path / "out.json"))
    rows = out["rows"]
    assert [(r["format"], r["engine"]) for r in rows] == [("sharded", "ours"), ("sharded", "transformers")]
    for r in rows:
        assert r["weights_mib"] > 1 and 0 < r["load_s"] <= r["ready_s"] and r["peak_extra_mib"] > 0
    assert out["built"][0]["params_m"] > 0.2 and out["built"][0]["save_s"] > 0


def test_generate_benchmark(tmp_path, capsys):
    from bench import generate

    assert (
        generate.main(
            [
                "--workload",
                "tiny",
                "--batch",
                "1",
                "4",
                "--new-tokens",
                "8",
                "--calls",
                "1",
                "--json",
                str(tmp_path / "out.json"),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "batch 1: ours" in table and "batch 4: ours" in table
    rows = json.load(open(tmp_path / "out.json"))["rows"]
    assert [(r["batch"], r["engine"]) for r in rows] == [
        (1, "ours"),
        (1, "transformers"),
        (4, "ours"),
        (4, "transformers"),
    ]
    assert all(r["first_s"] > 0 and r["median_s"] > 0 and r["tokens_per_s"] > 0 for r in rows)


def test_grpo_step_benchmark(tmp_path, capsys):
    from bench import grpo_step

    assert grpo_step.main(["--workload", "tiny", "--steps", "2", "--json", str(tmp_path / "out.json")]) == 0
    table = capsys.readouterr().out
    assert "f32 matmul peak on this machine" in table and "tiny: median" in table
    out = json.load(open(tmp_path / "out.json"))
    [row] = out["workloads"]
    assert out["matmul_peak_gflops"] > 0 and row["workload"] == "tiny" and len(row["steps"]) == 2
    assert row["step_s"] > 0 and row["gflops"] > 0 and row["trained_m"] == pytest.approx(row["params_m"], rel=1e-3)
    assert row["opt_state_mib"] > 2 * row["params_m"] * 4 / 1.05  # two AdamW moments in f32


def test_start_policy_benchmark(tmp_path, capsys):
    from bench import start_policy

    assert start_policy.main(["--workload", "tiny", "--repeats", "1", "--json", str(tmp_path / "out.json")]) == 0
    table = capsys.readouterr().out
    assert "checkpoint, params only" in table and "export (HF folder)" in table
    out = json.load(open(tmp_path / "out.json"))
    assert [r["mode"] for r in out["rows"]] == [
        "whole",
        "params",
        "export",
        "policy",
        "policy-init",
        "resume",
        "resume-init",
    ]
    assert "train state, resumed" in table
    assert all(r["seconds"] > 0 for r in out["rows"]) and out["built"]["params_m"] > 0.1


def test_profile_summary_names_the_programs_and_ops_that_took_the_time(tmp_path):
    """bench.profile reads XLA's own trace: the program that ran inside the capture is there, its
    ops' times add up, and a kept trace stays where asked."""
    import jax
    import jax.numpy as jnp

    from bench import profile

    @jax.jit
    def heavy(x):
        return jnp.tanh(x @ x).sum()

    x = jnp.ones((256, 256))
    heavy(x).block_until_ready()
    with profile.capture(str(tmp_path / "trace")) as cap:
        for _ in range(3):
            heavy(x).block_until_ready()
    s = cap.summary(top=5)
    assert s["ops"] and all(r["ms"] >= 0 and 0 <= r["share"] <= 1 for r in s["ops"])
    assert any("heavy" in p["program"] for p in s["programs"]), s["programs"]
    assert sum(r["share"] for r in s["ops"]) <= 1.0 + 1e-9
    assert list((tmp_path / "trace").rglob("*.xplane.pb"))
    table = profile.table(s)
    assert "XLA profile" in table and "heavy" in table


def test_rescore_benchmark_times_both_ways_to_the_same_loss(tmp_path, capsys):
    from bench import rescore

    assert rescore.main(["--workload", "tiny", "--reps", "1", "--json", str(tmp_path / "out.json")]) == 0
    table = capsys.readouterr().out
    assert "apart / in_update:" in table
    (row,) = json.load(open(tmp_path / "out.json"))
    for v in ("apart", "in_update"):
        assert 0 < row[v]["median_s"] and 0 < row[v]["first_s"]
    assert row["in_update"]["loss"] == pytest.approx(row["apart"]["loss"], rel=1e-4, abs=1e-6)
    assert row["ratio"] > 0


def test_agent_turns_benchmark(tmp_path, capsys):
    from bench import agent_turns

    args = ["--workload", "tiny", "--rows", "2", "--prompt", "8", "--new-tokens", "4", "--turns", "2", "--result", "2"]
    assert agent_turns.main([*args, "--json", str(tmp_path / "out.json")]) == 0
    table = capsys.readouterr().out
    assert "re-read share" in table and "a cache kept across turns would save at most" in table
    rows = json.load(open(tmp_path / "out.json"))["turns"]
    assert [(r["turn"], r["prompt_tokens"]) for r in rows] == [(1, 8), (2, 14)]
    assert all(r["prefill_s"] > 0 and r["decode_s"] >= 0 for r in rows) and 0 <= rows[1]["reread_share"] <= 1
    assert rows[1]["reread_tokens"] == 12  # what a kept cache would not read again: all but the last result
