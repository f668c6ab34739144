"""What a rollout draws, as the built-in sampler and every rollout engine return it. A NamedTuple:
a pytree as it stands, importable without JAX. Shapes: B = P * G rows (rows i*G .. i*G+G-1
follow prompt i), N completion tokens."""

from __future__ import annotations

from typing import Any, NamedTuple


class Completions(NamedTuple):
    """The rows a rollout draws: what the built-in sampler and every rollout engine return.
    Device arrays from grpo_core.generate.sampler.generate (until the caller reads them), numpy from
    a RolloutEngine."""

    tokens: Any  # (B, N) int32 sampled ids, pad after the stop token
    logprobs: Any  # (B, N) float32 log-prob of each token under softmax(logits / T), 0 after the end
    lengths: Any  # (B,) int32 tokens up to and including the stop token
    truncated: Any  # (B,) bool: no stop token within N
    # (B, N) bool: the tokens the policy generated, where an episode (grpo_core.agent) holds others
    # too (tool results, the template's glue), which are never trained; None: every token up to length
    trained: Any = None
