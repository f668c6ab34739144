"""The pipeline on a Hugging Face checkpoint: a tiny Qwen3 folder with a chat tokenizer (built by the
test), chat prompts from a JSONL file, a reward from a file; the run trains, evaluates and exports
export/{step}/ that transformers loads (model, tokenizer, generation config) with the logits of
the trained policy."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from grpo_core.store.root import RunRoot  # noqa: E402
from tests.cpu_devices import optimized_flags  # noqa: E402
from tests.hf_models import build_hf_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]

REWARD = """
def letters_of_answer(prompts, completions, answer, **_):
    return [len(set(c) & set(a)) / len(set(a)) for c, a in zip(completions, answer)]
"""


def hf_config(tmp_path, folder, **model):
    data = tmp_path / "prompts.jsonl"
    words = ["cat", "dog", "sun", "sky", "tree", "moon", "fish", "bird"]
    data.write_text("".join(json.dumps({"prompt": f"Repeat: {w}", "answer": w}) + "\n" for w in words))
    (tmp_path / "reward.py").write_text(REWARD)
    return {
        "run_name": "hf-run",
        "storage": {"root": str(tmp_path / "runs")},
        "model": {"path": str(folder), **model},
        "data": {
            "source": str(data),
            "chat": True,
            "system_prompt": "Answer briefly.",
            "max_prompt_tokens": 96,
            "eval_fraction": 0.25,
        },
        "rewards": [{"function": f"{tmp_path}/reward.py:letters_of_answer"}],
        "train": {
            "num_steps": 4,
            "grpo": {"prompts_per_step": 2, "num_generations": 4},
            "sampling": {"max_new_tokens": 8},
            "optimizer": {"learning_rate": 1e-2},
        },
        "eval": {"num_samples": 1, "batch_size": 4},  # the training reward decides accuracy
        "pipeline": {"epochs": 1, "checkpoint_every": 2, "retries": 0, "flow_retries": 0},
    }


def test_pipeline_trains_and_exports_a_hugging_face_model(tmp_path):
    from flows.pipeline import grpo_pipeline
    from grpo_core.nn.hf import load_hf_model

    folder = tmp_path / "tiny-qwen3"
    _, tok = build_hf_model(folder, "qwen3")
    s = grpo_pipeline.with_options(retries=0)(hf_config(tmp_path, folder))
    run = RunRoot(str(tmp_path / "runs" / "hf-run"))
    assert s["status"] == "completed" and s["steps"] == 4
    assert s["export_uri"] == run.uri("export", "4")
    info = run.done_info("export/4")
    assert info["step"] == 4 and {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
    } <= set(info["files"])

    # The prompts went through the chat template, with the system prompt, tokenized without a
    # second set of special tokens.
    cfg = run.read_json("config.json")
    rows = [json.loads(x) for x in run.read_bytes(f"data/{cfg['hashes']['data']}/train.jsonl").decode().splitlines()]
    assert rows[0]["prompt"].startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nRepeat: ")
    assert rows[0]["prompt_ids"] == tok.encode(rows[0]["prompt"], add_special_tokens=False)

    export = str(tmp_path / "runs" / "hf-run" / "export" / "4")
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(export)
    assert hf_tok.chat_template == tok.chat_template
    assert hf_tok.encode(rows[0]["prompt"], add_special_tokens=False) == rows[0]["prompt_ids"]
    gen = json.loads(open(os.path.join(export, "generation_config.json")).read())
    ids = tok.convert_tokens_to_ids
    assert gen["eos_token_id"] == [ids("<|im_end|>"), ids("<|endoftext|>")] and gen["temperature"] == 0.7

    # The export is the trained policy (not the starting weights), and transformers agrees with it.
    trained, start = load_hf_model(export), load_hf_model(str(folder))
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), jax.tree.leaves(trained), jax.tree.leaves(start))
    assert max(moved) > 0
    x = np.asarray([rows[0]["prompt_ids"]])
    with torch.no_grad():
        ref = hf(torch.tensor(x)).logits.numpy()
    got = np.asarray(trained(jnp.asarray(x)))
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4

    # A trained step's policy (evaluation, export) is read from its checkpoint alone: model.path's
    # weights are not read first and then overwritten (gone here, the same parameters come back).
    from flax import nnx

    from grpo_core.config.run import RunConfig
    from grpo_core.rl.checkpoint import Checkpointer
    from grpo_core.stages.parts import open_run

    os.remove(folder / "model.safetensors")
    parts = open_run(RunConfig.from_dict(cfg), run)
    with Checkpointer(run.uri("checkpoints"), max_to_keep=None) as ckpt:
        graphdef, params = parts.policy_at(ckpt, 4)
    same = jax.tree.map(lambda a, b: bool((a == b).all()), nnx.state(trained), params)
    assert all(jax.tree.leaves(same))

    # So is a resumed training stage's: without model.path's weights, the worker resumes from
    # checkpoint 2 and trains to the same step-4 policy.
    shutil.rmtree(tmp_path / "runs" / "hf-run" / "checkpoints" / "4")
    cmd = [sys.executable, "-m", "grpo_core.stages.worker", "train", "--until-step", "4", "--root", run.url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"event": "resumed", "step": 2, "until": 4} in [json.loads(line) for line in done.stdout.splitlines()]
    with Checkpointer(run.uri("checkpoints"), max_to_keep=None) as ckpt:
        graphdef, again = parts.policy_at(ckpt, 4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), nnx.state(trained), again)


# -- a user's path (issue 29, item 4) ---------------------------------------------------------

GSM8K_QUESTIONS = [
    ("Natalia sold {a} clips in April and {b} in May. How many clips did she sell?", lambda a, b: a + b),
    ("Weng earns ${a} an hour and worked {b} hours. How much did she earn?", lambda a, b: a * b),
    ("A box holds {a} pens. Tom takes {b} pens out. How many pens are left?", lambda a, b: a - b),
]


def gsm8k_jsonl(path, n: int, seed: int):
    """GSM8K-style rows as a user exports them: question, and an answer ending in '#### N'."""
    import random

    rng, rows = random.Random(seed), []
    for i in range(n):
        text, f = GSM8K_QUESTIONS[i % len(GSM8K_QUESTIONS)]
        a, b = rng.randint(10, 60), rng.randint(1, 9)
        rows.append({"question": text.format(a=a, b=b), "answer": f"{a} and {b} give {f(a, b)}.\n#### {f(a, b)}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# What the run resolves to, field by field (paths and versions aside): the 'hf' recipe's
# defaults (grpo_core.config.recipes) under the few fields this config sets. A default that
# drifts (back to the demo's 6 tokens and 5e-4, say) fails here.
PINNED_USER_RUN = {
    "data.chat": True,
    "data.eval_fraction": 0.1,
    "data.eval_rows": "all",
    "data.format": "auto",  # detected as gsm8k from the first row
    "data.max_prompt_tokens": 512,
    "data.system_prompt": "Think inside <think></think>, then give the final number inside <answer></answer>.",
    "eval.accuracy_reward": "math_answer",
    "eval.num_samples": 4,
    "eval.temperature": 1.0,
    "model.dtype": None,
    "model.tokenizer": "auto",
    "rewards": [
        {"function": "math_answer", "weight": 1.0, "params": None},
        {"function": "think_format", "weight": 0.2, "params": None},
    ],
    "train.grpo.beta": 0.0,
    "train.grpo.dynamic_sampling": False,
    "train.grpo.entropy_coef": 0.0,
    "train.grpo.epsilon_high": 0.2,
    "train.grpo.epsilon_low": 0.2,
    "train.grpo.loss_aggregation": "token_mean",
    "train.grpo.num_generations": 8,
    "train.grpo.prompts_per_step": 8,
    "train.grpo.scale_rewards": "group",
    "train.num_epochs": 3.0,
    "train.num_steps": 3,  # auto: ceil(3 epochs x 8 training rows / 8 prompts)
    "train.optimizer.b2": 0.999,
    "train.optimizer.learning_rate": 1e-06,
    "train.optimizer.max_grad_norm": 1.0,
    "train.optimizer.warmup_steps": 0,
    "train.optimizer.weight_decay": 0.0,
    "train.sampling.max_new_tokens": 256,
    "train.sampling.temperature": 1.0,
}


def _field(cfg: dict, path: str):
    for part in path.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else None
    return cfg


def test_a_users_path_qwen2_bpe_gsm8k_chat_to_an_export_transformers_generates_with(tmp_path, monkeypatch):
    """As a user would: a Qwen2 folder (random weights, a byte-level BPE tokenizer trained here),
    GSM8K-style JSONL with '#### N' answers for training and a test file evaluated whole, the
    chat template on, math_answer and a format reward, nothing else tuned. prepare -> train ->
    evaluate every test row -> export -> transformers loads the export and generates what our
    sampler generated. The worker runs with XLA's optimisations, as a user's does: the recipe's
    long completions compute more than they compile (52 instead of 68 CPU-s for the test)."""
    from flows.cli import main

    monkeypatch.setenv("XLA_FLAGS", optimized_flags())  # what the worker it starts inherits

    folder = tmp_path / "my-qwen2"
    _, tok = build_hf_model(folder, "qwen2", bpe=True)
    train, test = gsm8k_jsonl(tmp_path / "train.jsonl", 8, 0), gsm8k_jsonl(tmp_path / "test.jsonl", 7, 1)
    sets = [
        f"storage.root={tmp_path}/runs",
        "run_name=user-run",
        f"model.path={folder}",
        f"data.source={train}",
        f"data.eval_source={test}",
        "data.eval_rows=all",
        "data.chat=true",
        "data.system_prompt=Think inside <think></think>, then give the final number inside <answer></answer>.",
        "rewards=[{function: math_answer}, {function: think_format, weight: 0.2}]",
        "pipeline.epochs=1",
        "pipeline.retries=0",
        "pipeline.flow_retries=0",
    ]
    assert main(["run", *[a for s in sets for a in ("--set", s)]]) == 0
    run = RunRoot(str(tmp_path / "runs" / "user-run"))
    cfg = run.read_json("config.json")
    got = {k: _field(cfg, k) for k in PINNED_USER_RUN}
    assert got == PINNED_USER_RUN
    assert cfg["data"]["source"] == str(train) and cfg["model"]["path"] == str(folder)

    # prepared: the chat template with the system prompt, '#### N' read into ground_truth
    rows = [json.loads(x) for x in run.read_bytes(f"data/{cfg['hashes']['data']}/eval.jsonl").decode().splitlines()]
    assert len(rows) == 7 and rows[0]["prompt"].startswith("<|im_start|>system\nThink inside <think>")
    assert rows[0]["ground_truth"] == json.loads(test.read_text().splitlines()[0])["answer"].rsplit("#### ", 1)[1]

    # trained 3 steps, evaluated on every test row before and after
    summary = run.read_json("summary.json")
    assert summary["status"] == "completed" and summary["steps"] == 3
    final = run.read_json("eval/3.json")
    assert final["greedy"]["num_rows"] == 7.0 and 0.0 <= final["accuracy"] <= 1.0
    assert run.read_json("eval/0.json")["greedy"]["num_rows"] == 7.0

    # exported, loaded by transformers, generating what our greedy sampler generated at step 3
    export = str(tmp_path / "runs" / "user-run" / "export" / "3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(export)
    assert type(hf).__name__ == "Qwen2ForCausalLM" and hf_tok.chat_template == tok.chat_template
    ids = torch.tensor([rows[0]["prompt_ids"]])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    theirs = hf_tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    ours = final["examples"][0]["completion"]
    n = min(len(theirs), len(ours))
    assert n > 0 and theirs[:n] == ours[:n], (theirs, ours)
