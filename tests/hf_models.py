"""Tiny Hugging Face model folders for tests, built here (no hub): a character-level tokenizer with
chat special tokens and a Qwen-style chat template, a random Qwen3 or Llama model sized to it,
and a generation_config.json whose eos_token_id lists two stop tokens, as Qwen's instruct
models do. The tokenizers are the package's (grpo_core/nn/tiny_hf.py, which `grpo tiny-model` uses);
the models here are built with PyTorch, for the tests that compare against it."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

# the tokenizers and the tiny model's pieces live in the package, where `grpo tiny-model` builds with them
from grpo_core.nn.tiny_hf import (  # noqa: F401  (re-exported: the tests import them from here)
    CHARS,
    CHAT_TEMPLATE,
    GSM8K_TEXTS,
    LLAMA_CHAT_TEMPLATE,
    QWEN_SPECIALS,
    save_bpe_tokenizer,
    save_tokenizer,
)

# Llama 3.1's rope scaling at a tiny model's context: the tests' llama3 shape
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def build_hf_model(
    folder: pathlib.Path,
    arch: str = "qwen3",
    llama_tokenizer: bool = False,
    seed: int = 0,
    max_shard_size: str | None = None,
    bpe: bool = False,
):
    """Save a tiny random `arch` model (qwen3, qwen2, llama), its tokenizer (character-level, or
    with `bpe` a byte-level BPE trained here) and a generation config in `folder`.
    Returns (the torch model, the tokenizer)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tok = save_bpe_tokenizer(folder) if bpe else save_tokenizer(folder, llama=llama_tokenizer)
    common = _shape(tok)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
        model_cls = transformers.Qwen3ForCausalLM
    elif arch == "qwen2":  # attention bias on q/k/v, as Qwen2 and Qwen2.5
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model_cls = transformers.Qwen2ForCausalLM
    elif arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        model_cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(arch)
    model = _seeded(model_cls, cfg, seed)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kw)
    ids = tok.convert_tokens_to_ids
    stops = [ids("</s>")] if llama_tokenizer else [ids("<|im_end|>"), ids("<|endoftext|>")]
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": stops, "pad_token_id": tok.pad_token_id, "temperature": 0.7, "top_p": 0.8})
    )
    return model, tok


def hub_cache(cache: pathlib.Path, repo_id: str, folder, revision: str = "0" * 40) -> pathlib.Path:
    """A Hub cache entry as huggingface_hub lays it out: refs/main -> snapshots/{commit}/files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    shutil.copytree(folder, repo / "snapshots" / revision)
    return repo / "snapshots" / revision


def run_offline(code: str, cache: pathlib.Path) -> dict:
    """Run `code` in a fresh interpreter with `cache` as the Hugging Face cache and the Hub offline
    (huggingface_hub reads both when it is imported); the JSON its last line prints."""
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build_hf_classifier(
    folder: pathlib.Path, arch: str = "qwen2", seed: int = 0, max_shard_size: str | None = None, extra=None
):
    """Save a tiny random one-label `arch` *ForSequenceClassification (qwen2, qwen3, llama: a reward
    model, as AutoModelForSequenceClassification(num_labels=1) saves one) and its character-level
    tokenizer (Llama-like for llama) in `folder`. Returns (the torch model, the tokenizer)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    llama = arch == "llama"
    tok = save_tokenizer(folder, llama=llama)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    common = dict(_shape(tok), num_labels=1, pad_token_id=pad, **(extra or {}))
    names = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama"}
    if arch not in names:
        raise ValueError(arch)
    cfg = getattr(transformers, f"{names[arch]}Config")(**common)
    model = _seeded(getattr(transformers, f"{names[arch]}ForSequenceClassification"), cfg, seed)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kw)
    return model, tok


def _shape(tok) -> dict:
    """The tiny models' shape: 2 layers, hidden 64, grouped-query attention (4 heads, 2 KV heads)."""
    return dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )


def _seeded(model_cls, cfg, seed: int):
    """`model_cls(cfg)` initialised from `seed`, its near-uniform init spread so that logits and
    scores differ between inputs."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model
