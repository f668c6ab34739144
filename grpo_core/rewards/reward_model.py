"""A reward that is a model: `rewards: [{model: ID_OR_FOLDER, weight: w}]`, as TRL's GRPOTrainer takes a
model id among its reward_funcs. The model is a Hugging Face *ForSequenceClassification with one
label (Qwen2, Qwen3, Llama); its score of each (prompt, completion) is the reward, used as it is
(or clipped to rewards[].clip), logged as rewards/<name>/mean with <name> the last part of its id.

What it reads is what TRL gives a reward model: for chat data the prompt's messages and the
completion as the assistant's message (an episode's messages, with train.agent) through the reward
model's own chat template; for plain data the prompt and the completion as one text; either
tokenized by the reward model's own tokenizer without special tokens added (the completions come
decoded by the policy's: two tokenizers are the normal case). A text longer than
rewards[].max_length loses its first tokens: the end, where the score is read, is kept.

This side is JAX-free (the registry makes these in the Prefect process, which checks config.json
there); `open` loads the weights onto the run's devices (grpo_core.nn.reward_model), in a
worker, which the trainer and the evaluation do before scoring.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import numpy as np

from grpo_core.config.memory import RewardModelShape
from grpo_core.config.model import ModelConfig, classifier_config
from grpo_core.config.run import RewardSpec
from grpo_core.errors import ConfigError
from grpo_core.store.sources import looks_local, read_config, resolve

log = logging.getLogger(__name__)


class ModelReward:
    """A reward model as a reward function `f(prompts, completions, **_) -> list[float]`."""

    def __init__(self, spec: RewardSpec, field: str):
        self.spec, self.field = spec, field  # field: rewards[i].model, named in every message
        self.__name__ = spec.name
        self.scorer = None  # grpo_core.nn.reward_model.Scorer, once open
        self.tokenizer = None
        self._cut = 0  # texts cut to max_length so far (the log says so once)

    def __repr__(self) -> str:
        return f"ModelReward({self.spec.model!r})"

    def config(self, dtype: str = "float32") -> ModelConfig:
        """The classifier's trunk in `dtype` from its config.json (fetched without the weights), or
        ConfigError naming the field: not a one-label sequence classifier, or not a supported one."""
        hf = read_config(self.spec.model, None, self.field)
        return classifier_config(hf, f"{self.field} {self.spec.model!r}: config.json", dtype=dtype, param_dtype=dtype)

    def shape(self, dtype: str = "float32") -> RewardModelShape:
        """What the memory plan counts of it."""
        s = self.spec
        return RewardModelShape(self.config(dtype), s.model_batch_size, s.model_max_length, s.name)

    def missing_here(self) -> bool:
        """A local folder that is not on this machine (it may be where the workers run)."""
        return looks_local(self.spec.model) and not os.path.isdir(os.path.expanduser(self.spec.model))

    def open(self, placement=None, dtype: str = "float32") -> "ModelReward":
        """Load its tokenizer, and its weights in `dtype` onto the placement's reference mesh (as
        the KL reference is laid out; one device without a placement). A worker opens each once."""
        if self.scorer is not None and (placement is None or self.scorer.placement is placement):
            return self
        from grpo_core.nn.reward_model import open_scorer  # JAX: only a worker opens a reward model

        folder = resolve(self.spec.model, None, weights=True, field=self.field)
        self.tokenizer = self.tokenizer or _tokenizer(folder, self.field)
        pool_pad = read_config(self.spec.model, None, self.field).get("pad_token_id")
        tok = self.tokenizer
        pad = next((i for i in (pool_pad, tok.pad_token_id, tok.eos_token_id) if i is not None), 0)
        self.scorer = open_scorer(
            folder,
            dtype,
            self.spec.model_batch_size,
            self.spec.model_max_length,
            int(pad),
            pool_pad,
            placement,
            where=self.field,
        )
        return self

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """What it scores, as TRL builds it: chat messages through its chat template, else prompt + completion."""
        if completions and isinstance(completions[0], list):
            if not getattr(self.tokenizer, "chat_template", None):
                raise ConfigError(
                    f"{self.field} {self.spec.model!r}: the data's prompts are chat messages, and this reward "
                    "model's tokenizer has no chat template to write them with; use a reward model with one, or "
                    "plain prompts (data.chat: false)"
                )
            return [
                self.tokenizer.apply_chat_template([*_messages(p), *c], tokenize=False)
                for p, c in zip(prompts, completions)
            ]
        return [_text(p) + _text(c) for p, c in zip(prompts, completions)]

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text by its own tokenizer (no special tokens added, as TRL), each cut to
        its last max_length tokens."""
        most = self.spec.model_max_length
        rows = [list(map(int, ids)) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
        cut = sum(len(r) > most for r in rows)
        if cut and not self._cut:
            log.warning(
                "%s %r: %d of %d texts are longer than %d tokens; each is scored on its last %d (rewards[].max_length)",
                self.field,
                self.spec.name,
                cut,
                len(rows),
                most,
                most,
            )
        self._cut += cut
        return [r[-most:] for r in rows]

    def __call__(self, prompts, completions, **_: Any) -> list[float]:
        if self.scorer is None:
            raise RuntimeError(f"{self.field} {self.spec.model!r} is not loaded: a worker opens it before scoring")
        scores = self.scorer(self.encode(self.texts(prompts, completions))).astype(np.float64)
        if self.spec.clip is not None:
            scores = np.clip(scores, *self.spec.clip)
        return scores.tolist()


def _messages(prompt: Any) -> list[dict[str, Any]]:
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def _text(x: Any) -> str:
    if isinstance(x, list):  # messages: their contents
        return "".join(str(m.get("content") or "") for m in x)
    return str(x)


def _tokenizer(folder: str, field: str):
    from transformers import AutoTokenizer  # heavy (~2 s): only a worker that opens a reward model needs it

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, its own types
        raise ConfigError(f"{field}: cannot load the reward model's tokenizer from {folder}: {exc}") from None


def model_rewards(rewards: Sequence[Any]) -> list[ModelReward]:
    """The ModelRewards among `rewards` (grpo_core.rewards.functions.Reward), each once."""
    out: list[ModelReward] = []
    for r in rewards:
        if isinstance(r.fn, ModelReward) and all(r.fn is not m for m in out):
            out.append(r.fn)
    return out


def open_all(rewards: Sequence[Any], placement=None, dtype: str = "float32") -> list[ModelReward]:
    """Open every reward model among `rewards` (grpo_core.rewards.functions.Reward) on the placement."""
    return [m.open(placement, dtype) for m in model_rewards(rewards)]


def shapes(rewards: Sequence[Any], dtype: str = "float32") -> tuple[RewardModelShape, ...]:
    """What the memory plan counts of the reward models among `rewards`, each model once."""
    return _shapes([(m.field, m.spec) for m in model_rewards(rewards)], dtype)


def config_shapes(cfg, dtype: str | None = None) -> tuple[RewardModelShape, ...]:
    """The reward models of a RunConfig (rewards[].model, eval.rewards[].model) as the plan counts
    them, in the run's compute dtype: from their config.json alone (the Prefect side's readiness
    request)."""
    return _shapes(cfg.reward_models, dtype or cfg.compute_dtype.value)


def _shapes(specs: Sequence[tuple[str, RewardSpec]], dtype: str) -> tuple[RewardModelShape, ...]:
    """The shape of each (field, spec)'s model, one per model, batch size and length."""
    seen: dict[tuple[Any, ...], RewardModelShape] = {}
    for field, s in specs:
        key = (s.model, s.model_batch_size, s.model_max_length)
        if key not in seen:
            seen[key] = ModelReward(s, field).shape(dtype)
    return tuple(seen.values())
