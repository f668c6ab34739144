"""The tokenizer a run uses, from its config: the data stage tokenizes prompts with it, the
workers decode completions with it."""

from __future__ import annotations

from grpo_core.config.run import RunConfig
from grpo_core.data.synthetic import CharTokenizer
from grpo_core.store.sources import load_tokenizer


def make_tokenizer(cfg: RunConfig):
    """The tokenizer named by model.tokenizer: 'char' (the built-in character tokenizer), 'auto'
    (AutoTokenizer of model.path, with its generation config's stop ids) or another HF id/folder."""
    if cfg.tokenizer_source is None:
        return CharTokenizer()
    own = cfg.model.tokenizer == "auto"  # the model folder's own tokenizer
    field = f"model.tokenizer (auto: the tokenizer of model.path {cfg.model_path!r})" if own else "model.tokenizer"
    rev = cfg.model.revision if cfg.tokenizer_source == cfg.model_path else None
    return load_tokenizer(cfg.tokenizer_source, rev, field)
