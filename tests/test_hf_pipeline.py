"""The pipeline on a Hugging Face checkpoint: a tiny Qwen3 folder with a chat tokenizer (built by the
test), chat prompts from a JSONL file, a reward from a file; the run trains, evaluates and exports
export/{step}/ that transformers loads (model, tokenizer, generation config) with the logits of
the trained policy."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from grpo_core.store.root import RunRoot  # noqa: E402
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
