"""The records passed between the sampler, the rollout engines, the trainer and the learner.

NamedTuples: pytrees as they stand (jax.jit, jax.tree.map, device_get and the mesh's put_batch
take them whole) and importable without JAX. Build them with keywords: the fields are many and
alike. Completions, what a rollout draws, lives with the sampler (grpo_core.generate.types).

Shapes: P prompts, each with G completions (B = P * G rows; rows i*G .. i*G+G-1 follow prompt
i), Tp prompt tokens (left-padded), N completion tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypedDict

from grpo_core.generate.types import Completions  # noqa: F401 - the rows a rollout draws; re-exported


class Batch(NamedTuple):
    """One update's inputs to the learner (grpo_core.rl.learner): each prompt once, its G
    completions after it. The learner splits it into micro-batches of whole groups."""

    prompt_tokens: Any  # (P, Tp) int32, left-padded
    prompt_valid: Any  # (P, Tp) bool
    targets: Any  # (B, N) int32: the completions' tokens
    mask: Any  # (B, N) float32: 1 on the tokens that count in the loss
    advantages: Any  # (B,) float32
    old_logp: Any  # (B, N) float32: the behaviour policy's log-probs (the sampler's, or rescored)
    ref_logp: Any  # (B, N) float32: the reference policy's (zeros when beta == 0)
    # (B, N) float32: the truncated importance weight of each token between the learner's and the
    # rollout engine's log-probs (train.rollout.is_correction); None: no correction (all 1)
    rollout_weight: Any = None

    PER_PROMPT = ("prompt_tokens", "prompt_valid")  # (P, ...) fields; the others have B rows

    def map_rows(self, per_prompt, per_completion) -> "Batch":
        """The batch with `per_prompt` applied to its (P, ...) arrays and `per_completion` to its
        (B, ...) arrays (e.g. a gather of some groups' prompts and of their rows)."""
        fn = lambda k: per_prompt if k in self.PER_PROMPT else per_completion
        return Batch(**{k: None if v is None else fn(k)(v) for k, v in self._asdict().items()})


class TrainState(TypedDict):
    """The learner's state, and the pytree a checkpoint (grpo_core.rl.checkpoint) saves: a plain
    dict, so its saved layout and key names stay those of every existing run folder."""

    params: Any  # nnx.State: the trained parameters (under LoRA, the adapters only)
    opt_state: Any  # the optax state
    step: Any  # int32 scalar: optimizer updates done
