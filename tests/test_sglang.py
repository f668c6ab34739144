"""sglang-jax as a rollout engine, on CPU, in its own interpreter (.venv-sglang: Python 3.12 with
sglang-jax's pins). This process never imports sgl_jax: the in-process engine runs in a child
of that interpreter (an internal engine error ends its whole process), the HTTP engine talks
to a sglang-jax server it starts on 127.0.0.1. `make test` builds the environment first; the
tests skip only where it is absent."""

import json
import os
import subprocess

import jax
import numpy as np
import pytest

from grpo_core.launch.processes import sglang_python

SGLANG_PYTHON = sglang_python()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        SGLANG_PYTHON is None,
        reason="the sglang-jax environment (.venv-sglang, Python 3.12) is not "
        "built: run `make sglang-env` (make test builds it)",
    ),
]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def test_engine_matches_the_sampler_and_weight_syncs_change_outputs(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [SGLANG_PYTHON, "-m", "grpo_core.stages.engine_selftest", "--json", str(out)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["python"].startswith("3.12")
    assert report["checks"] == {
        "greedy_matches_sampler": True,
        "sync_changes_outputs": True,
        "sync_back_restores": True,
        "stop_token_matches": True,
        "sampling_reproducible": True,
        "sampled_logprobs_are_learners": True,
        "lora_merged_sync": True,
    }, report.get("detail")
    assert proc.returncode == 0 and report["ok"]
    assert all(s < 5.0 for s in report["weight_sync_s"])


def test_train_worker_runs_in_the_sglang_environment(tmp_path):
    """The pipeline's path: readiness and the training worker in the sglang-jax interpreter,
    a checkpoint, then a resumed worker whose engine is synced to the restored weights."""
    from grpo_core.config.run import RunConfig
    from grpo_core.data.prepare import prepare_dataset
    from grpo_core.data.tokenizer import make_tokenizer
    from grpo_core.store.runs import init_run_root
    from tasks.process import run_worker
    from tasks.readiness import readiness_report, worker_python

    cfg = RunConfig.from_dict(
        {
            "run_name": "sgl",
            "storage": {"root": str(tmp_path)},
            "model": {"preset": "tiny", "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128},
            "data": {"eval_rows": 8, "synthetic_rows": 64},
            "train": {
                "num_steps": 3,
                "grpo": {"prompts_per_step": 4, "num_generations": 4},
                "optimizer": {"learning_rate": 1e-2},
                "rollout": {
                    "engine": "sglang",
                    "disable_precompile": True,
                    "max_total_tokens": 2048,
                    "context_length": 128,
                    "start_timeout_s": 300,
                    "sync_timeout_s": 120,
                },
            },
            "pipeline": {"checkpoint_every": 2},
        }
    )
    assert worker_python(cfg) == SGLANG_PYTHON
    prepare_dataset(cfg.data, make_tokenizer(cfg), init_run_root(cfg), cfg.tokenizer_id)
    checks = {c["name"]: c for c in readiness_report(cfg)["checks"]}
    assert checks["rollout_engine"]["ok"] and "in process on CPU" in checks["rollout_engine"]["detail"]

    def train(until):
        return run_worker(
            ["grpo_core.stages.worker", "train", "--root", cfg.run_url, "--until-step", str(until)],
            timeout_s=600,
            on_event=lambda e: None,
            what="sglang training",
            env={"JAX_PLATFORMS": "cpu"},
            python=worker_python(cfg),
        )

    first = train(2)
    assert [e["event"] for e in first] == ["memory", "start", "step", "step", "checkpoint", "done"]
    again = train(3)
    assert again[1] == {"event": "resumed", "step": 2, "until": 3} and again[-1]["steps_run"] == 1
    assert all(np.isfinite(e["reward"]) for e in first + again if e["event"] == "step")


def test_http_engine_trains_against_a_sglang_jax_server():
    """GRPO steps whose rollouts come from a sglang-jax server this engine starts on 127.0.0.1
    and restarts on each exported policy; after training it serves the learner's weights."""
    import copy

    from grpo_core.rl.sampler import SamplerOptions, generate, pad_prompts, step_key
    from grpo_core.rl.trainer import GRPOTrainer
    from grpo_core.testing import SYNTHETIC_DEFAULT, build_synthetic

    cfg = copy.deepcopy(SYNTHETIC_DEFAULT)
    cfg["model"].update(num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    cfg["train"].update(num_steps=2)
    cfg["train"]["grpo"].update(prompts_per_step=4, num_generations=4)
    cfg["train"]["optimizer"].update(learning_rate=1e-2, warmup_steps=0)
    cfg["train"]["rollout"] = {
        "engine": "http",
        "server": "sglang-jax",
        "sync_every": 2,
        "disable_precompile": True,
        "max_total_tokens": 2048,
        "context_length": 128,
        "start_timeout_s": 300,
        "generate_timeout_s": 120,
    }
    run = build_synthetic(cfg)
    tr = GRPOTrainer(run.model, run.train, run.tokenizer, run.rewards, run.task)
    try:
        hist = tr.train()
        engine = tr.engine
        assert engine.served_step == 2 and engine.server.starts == 2  # step 0's weights, then step 2's
        assert abs(hist[0]["ratio_mean"] - 1.0) < 1e-3  # the server's log-probs are the behaviour policy's
        assert all(np.isfinite(m["loss"]) for m in hist) and hist[-1]["time/sync"] > 0
        # Greedy through the server equals the sampler on the learner's current weights.
        greedy = SamplerOptions(6, 0.0, 0, 1.0, tr.opts.eos_ids, tr.opts.pad_id)
        rows = [tr.tokenizer.encode(r["prompt"]) for r in run.task.sample(99, 0, 4)]
        ptok, pval = pad_prompts(rows, (8,), tr.opts.pad_id)
        engine.opts = greedy
        got = engine.generate(ptok, pval, step_key(0, 99), 1)
        ref = generate(tr.graphdef, tr.params, ptok, pval, step_key(0, 99), greedy, 1)
        assert np.array_equal(got.tokens, np.asarray(ref.tokens)) and np.array_equal(
            got.lengths, np.asarray(ref.lengths)
        )
        assert float(np.max(np.abs(got.logprobs - np.asarray(ref.logprobs)))) < 1e-3
        server_pid = engine.server.proc.pid
    finally:
        tr.close()
    with pytest.raises(ProcessLookupError):
        os.killpg(server_pid, 0)  # the server's whole process group is gone
    assert jax.default_backend() == "cpu"
