"""Tiny Hugging Face model folders for tests, built here (no hub): a character-level tokenizer with
chat special tokens and a Qwen-style chat template, a random Qwen3 or Llama model sized to it,
and a generation_config.json whose eos_token_id lists two stop tokens, as Qwen's instruct
models do."""

from __future__ import annotations

import json
import pathlib
import string

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


def build_hf_model(
    folder: pathlib.Path,
    arch: str = "qwen3",
    llama_tokenizer: bool = False,
    seed: int = 0,
    max_shard_size: str | None = None,
):
    """Save a tiny random `arch` model, its tokenizer and a generation config in `folder`.
    Returns (the torch model, the tokenizer)."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tok = save_tokenizer(folder, llama=llama_tokenizer)
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
