"""The tokenizer a run uses, from its config: the data stage tokenizes prompts with it, the
workers decode completions with it."""

from __future__ import annotations

from typing import Any

from grpo_core.config.run import RunConfig
from grpo_core.data.synthetic import CharTokenizer
from grpo_core.store.sources import load_tokenizer


def make_tokenizer(cfg: RunConfig, tools: bool = True):
    """The tokenizer named by model.tokenizer: 'char' (the built-in character tokenizer), 'auto'
    (AutoTokenizer of model.path, with its generation config's stop ids) or another HF id/folder.
    With train.agent, a Hugging Face tokenizer's chat template renders the run's tools into each
    prompt (WithTools), as TRL renders them (`tools`: False for the tokenizer alone)."""
    if cfg.tokenizer_source is None:
        return CharTokenizer()
    own = cfg.model.tokenizer == "auto"  # the model folder's own tokenizer
    field = f"model.tokenizer (auto: the tokenizer of model.path {cfg.model_path!r})" if own else "model.tokenizer"
    rev = cfg.model.revision if cfg.tokenizer_source == cfg.model_path else None
    tok = load_tokenizer(cfg.tokenizer_source, rev, field)
    if tools and cfg.train.agent.enabled:
        from grpo_core.agent.tools import load_toolbox  # the tools' code: only a run with tools loads it

        return WithTools(tok, load_toolbox(cfg.train.agent).schemas)
    return tok


class WithTools:
    """A tokenizer whose chat template is given the run's tools' schemas (`tools=`) unless a call
    passes its own; everything else is the tokenizer's."""

    def __init__(self, tokenizer: Any, schemas: list[dict[str, Any]]):
        self._tokenizer, self.schemas = tokenizer, schemas

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, messages, **kwargs):
        kwargs.setdefault("tools", self.schemas or None)
        return self._tokenizer.apply_chat_template(messages, **kwargs)
