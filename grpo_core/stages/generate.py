"""Completions from a Hugging Face folder (a run's export, or any Qwen2/Qwen3/Llama folder) with
the project's own JAX model and sampler: what `grpo generate FOLDER PROMPT...` runs, in the
environment `make demo` installs (no PyTorch needed).

    python -m grpo_core.stages.generate FOLDER [--max-new-tokens N] [--chat] PROMPT [PROMPT ...]

Greedy; each prompt's completion printed on a line of its own after the prompt. A folder whose
tokenizer is the built-in character tokenizer (the demo's export) encodes prompts with it.
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

from grpo_core.errors import ConfigError
from grpo_core.generate.sampler import SamplerOptions, completion_texts, generate, pad_prompts, stop_ids
from grpo_core.nn.hf import load_hf_model
from grpo_core.store.sources import HFTokenizer

BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def complete(folder: str, prompts: list[str], max_new_tokens: int = 64, chat: bool = False) -> list[str]:
    """Greedy completions of `prompts` by the model in `folder`."""
    tok = HFTokenizer(folder, "FOLDER")
    model = load_hf_model(folder)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        if chat
        else p
        for p in prompts
    ]
    ptok, pval = pad_prompts([tok.encode(t) for t in texts], BUCKETS, tok.pad_token_id)
    opts = SamplerOptions(max_new_tokens, 0.0, 0, 1.0, tuple(stop_ids(tok)), tok.pad_token_id)
    out = generate(model, None, ptok, pval, jax.random.key(0), opts)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    return completion_texts(tok, tokens, lengths, opts.eos_ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="grpo generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="a Hugging Face model folder (a run's export/STEP/)")
    ap.add_argument("prompts", nargs="+", help="prompts, each completed greedily")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--chat", action="store_true", help="render each prompt through the tokenizer's chat template")
    args = ap.parse_args(argv)
    try:
        for prompt, text in zip(args.prompts, complete(args.folder, args.prompts, args.max_new_tokens, args.chat)):
            print(f"{prompt!r} -> {text!r}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
