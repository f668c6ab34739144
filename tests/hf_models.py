"""Tiny Hugging Face model folders for tests, built here (no hub): a character-level tokenizer with
chat special tokens and a Qwen-style chat template, a random Qwen3 or Llama model sized to it,
and a generation_config.json whose eos_token_id lists two stop tokens, as Qwen's instruct
models do."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import string
import subprocess
import sys

CHARS = string.ascii_letters + string.digits + " .,:;?!#=+-*/()<>'\"\n"
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA_CHAT_TEMPLATE = "{{ bos_token }}" + CHAT_TEMPLATE


def save_tokenizer(folder: pathlib.Path, llama: bool = False):
    """A character-level fast tokenizer. Qwen-like: no BOS, pad <|endoftext|>, EOS <|im_end|>.
    Llama-like: BOS <s> put in front of plain text by the post-processor and by the chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", *QWEN_SPECIALS] if llama else QWEN_SPECIALS
    vocab = {t: i for i, t in enumerate([*specials, *CHARS])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    if llama:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
        tok = PreTrainedTokenizerFast(
            tokenizer_object=tk, bos_token="<s>", eos_token="</s>", additional_special_tokens=QWEN_SPECIALS
        )
        tok.chat_template = LLAMA_CHAT_TEMPLATE
    else:
        tok = PreTrainedTokenizerFast(
            tokenizer_object=tk,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            additional_special_tokens=QWEN_SPECIALS,
        )
        tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    return tok


GSM8K_TEXTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Natalia sold 48/2 = 24 clips in May. Natalia sold 48+24 = 72 clips altogether in April and May. #### 72",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "<think>12/60 = 0.2 per minute; 0.2 x 50 = 10</think><answer>10</answer>",
    "What is 13+14? Answer: 27",
]


def save_bpe_tokenizer(folder: pathlib.Path, texts=GSM8K_TEXTS, vocab_size: int = 400, chat: bool = True):
    """A byte-level BPE tokenizer trained here (any UTF-8 text encodes), Qwen-like: no BOS, pad
    <|endoftext|>, EOS <|im_end|>, the chat specials and template; saved as users save one
    (tokenizer.json, tokenizer_config.json: no config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=QWEN_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(list(texts) * 10, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=QWEN_SPECIALS
    )
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    return tok


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
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tok = save_bpe_tokenizer(folder) if bpe else save_tokenizer(folder, llama=llama_tokenizer)
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
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
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # spread the near-uniform init so logits differ between tokens
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
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
