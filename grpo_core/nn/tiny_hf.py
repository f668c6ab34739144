"""Tiny Hugging Face model folders, built here with no download: a tokenizer (character-level, or
a byte-level BPE trained here, which encodes any UTF-8 text) with chat special tokens and a
Qwen-style chat template (with tools, in `grpo tiny-model`'s folders), random Qwen3 or Qwen2 weights sized to it, and a
generation_config.json whose eos_token_id lists two stop tokens, as Qwen's instruct models do.

`grpo tiny-model DIR` writes one (the quickstart's offline model), and the tests build their
tokenizers with the same functions (tests/hf_models.py). Needs no JAX and no PyTorch: the
weights are numpy arrays written with safetensors under Hugging Face's names, and config.json
is grpo_core.config.model.hf_config's, so `transformers` and `model.path` load the folder alike.
"""

from __future__ import annotations

import json
import pathlib
import string

import numpy as np
from safetensors.numpy import save_file

from grpo_core.config.model import DType, ModelConfig, hf_classifier_config, hf_config

CHARS = string.ascii_letters + string.digits + " .,:;?!#=+-*/()<>'\"\n"
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA_CHAT_TEMPLATE = "{{ bos_token }}" + CHAT_TEMPLATE
# CHAT_TEMPLATE with tools, in Qwen2.5/Qwen3's layout (what `grpo tiny-model` writes): the tools'
# JSON schemas in the system turn, a call as a <tool_call>{json}</tool_call> block after the
# assistant's text, results as <tool_response> blocks in one user turn. Without tools it renders
# what CHAT_TEMPLATE renders.
TOOLS_CHAT_TEMPLATE = (
    "{% set skip_system = tools and messages and messages[0]['role'] == 'system' %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if skip_system %}{{ messages[0]['content'] }}{{ '\n\n' }}{% endif %}"
    "You can call these tools, described as JSON schemas:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}{{ '\n' }}{% endfor %}"
    '</tools>\nTo call one, write <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.<|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}"
    "{% if loop.first and skip_system %}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user\n{% endif %}"
    "<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% else %}{{ '\n' }}{% endif %}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] is defined and m['tool_calls'] %}"
    "<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] %}<tool_call>\n"
    "{\"name\": {{ c['function']['name'] | tojson }}, \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# What the BPE tokenizer is trained on: GSM8K-like text, so numbers and words get merges.
GSM8K_TEXTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Natalia sold 48/2 = 24 clips in May. Natalia sold 48+24 = 72 clips altogether in April and May. #### 72",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "<think>12/60 = 0.2 per minute; 0.2 x 50 = 10</think><answer>10</answer>",
    "What is 13+14? Answer: 27",
]


def save_tokenizer(folder: pathlib.Path, llama: bool = False):
    """A character-level fast tokenizer. Qwen-like: no BOS, pad <|endoftext|>, EOS <|im_end|>.
    Llama-like: BOS <s> put in front of plain text by the post-processor and by the chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors  # heavy: tokenizers
    from transformers import PreTrainedTokenizerFast  # heavy: transformers

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


def save_bpe_tokenizer(
    folder: pathlib.Path, texts=GSM8K_TEXTS, vocab_size: int = 400, chat: bool = True, template: str = CHAT_TEMPLATE
):
    """A byte-level BPE tokenizer trained here (any UTF-8 text encodes), Qwen-like: no BOS, pad
    <|endoftext|>, EOS <|im_end|>, the chat specials and template; saved as users save one
    (tokenizer.json, tokenizer_config.json: no config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # heavy: tokenizers
    from transformers import PreTrainedTokenizerFast  # heavy: transformers

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
        tok.chat_template = template
    tok.save_pretrained(str(folder))
    return tok


def tiny_config(vocab_size: int, arch: str = "qwen3") -> ModelConfig:
    """The tests' tiny shape (2 layers, width 64, grouped-query attention) as `arch`."""
    if arch not in ("qwen3", "qwen2"):
        raise ValueError(f"arch must be qwen3 or qwen2, got {arch!r}")
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        qk_norm=arch == "qwen3",  # Qwen3: RMSNorm over each head of q and k
        attention_bias=arch == "qwen2",  # Qwen2: bias on q/k/v
        dtype=DType.FLOAT32,
    )


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random f32 weights under Hugging Face's tensor names (linears as (out, in)); norms at 1."""
    rng = np.random.default_rng(seed)
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)  # spread, so logits differ between tokens

    out = {"model.embed_tokens.weight": normal(cfg.vocab_size, h), "model.norm.weight": np.ones(h, np.float32)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = normal(cfg.vocab_size, h)
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
        out.update({f"{p}self_attn.{name}.weight": normal(*shape) for name, shape in shapes.items()})
        out.update({f"{p}mlp.{m}.weight": normal(i, h) for m in ("gate_proj", "up_proj")})
        out[f"{p}mlp.down_proj.weight"] = normal(h, i)
        out[f"{p}input_layernorm.weight"] = np.ones(h, np.float32)
        out[f"{p}post_attention_layernorm.weight"] = np.ones(h, np.float32)
        if cfg.attention_bias:
            out.update({f"{p}self_attn.{b}.bias": normal(shapes[b][0]) for b in ("q_proj", "k_proj", "v_proj")})
        if cfg.qk_norm:
            out[f"{p}self_attn.q_norm.weight"] = np.ones(d, np.float32)
            out[f"{p}self_attn.k_norm.weight"] = np.ones(d, np.float32)
    return out


def write_tiny_model(
    folder: str | pathlib.Path, arch: str = "qwen3", seed: int = 0, reward_model: bool = False
) -> pathlib.Path:
    """A small random `arch` model (Qwen3 or Qwen2) with a byte-level BPE tokenizer trained here and a
    generation config in `folder`: a Hugging Face folder to give as `model.path`. `reward_model`:
    a one-label *ForSequenceClassification of the same trunk instead (no LM head, a score head
    (1, hidden)), to give as a reward's `model`."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = save_bpe_tokenizer(folder, template=TOOLS_CHAT_TEMPLATE)  # Qwen's layout, with tools
    cfg = tiny_config(len(tok), arch)
    if reward_model:
        weights = random_weights(cfg, seed)
        weights["score.weight"] = (np.random.default_rng(seed + 1).standard_normal((1, cfg.hidden_size)) * 0.2).astype(
            np.float32
        )
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        config = hf_classifier_config(cfg, tok.pad_token_id)
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        return folder
    save_file(random_weights(cfg, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    ids = tok.convert_tokens_to_ids
    stops = [ids("<|im_end|>"), ids("<|endoftext|>")]
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": stops, "pad_token_id": tok.pad_token_id, "temperature": 0.7, "top_p": 0.8})
    )
    return folder
