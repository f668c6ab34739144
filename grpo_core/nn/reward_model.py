"""A reward model in JAX: a Hugging Face Qwen2, Qwen3 or Llama *ForSequenceClassification (one
label), loaded into the project's own decoder with a score head, and scored batched and jitted on
the run's devices.

HF's classifier is the causal LM's trunk (`model.*`, the same names as CausalLM's) and a linear
`score` (hidden, labels) without bias; its score of a text is the score head at the rightmost
token that is not the pad id (transformers' pooling: with right or left padding, the last real
token, and a text that ends in pad-id tokens is scored before them). Rows here are left-padded
(positions count only real tokens: grpo_core.nn.model.causal_inputs), padded in length to a power
of two up to the reward model's max_length and in rows to its batch size: one program per length
bucket, compiled once.

Shapes: B rows, T tokens, E hidden.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_core.config.model import ModelConfig, classifier_config
from grpo_core.nn.hf import load_weights, read_hf_config
from grpo_core.nn.model import Decoder, _linear, causal_inputs, rope_inv_freq
from grpo_core.runtime.mesh import BATCH, constrain, to_host

log = logging.getLogger(__name__)

MIN_BUCKET = 64  # the shortest length a batch is padded to


class SequenceClassifier(nnx.Module):
    """The decoder trunk (HF: `model`) and a score head (HF: `score`, (E, labels), no bias)."""

    def __init__(self, cfg: ModelConfig, num_labels: int = 1, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Decoder(cfg, rngs)
        self.score = _linear(cfg.hidden_size, num_labels, False, cfg, rngs)

    def __call__(self, tokens: jax.Array, valid: jax.Array, pool: jax.Array, mesh=None) -> jax.Array:
        """tokens, valid (B, T); pool (B,): the position each row is scored at -> (B,) f32, the
        first label's score. `mesh`: the rows' hidden states laid out over its data x fsdp axes, as
        the learner's are (grpo_core.nn.model.CausalLM.hidden_states_grouped)."""
        positions, mask = causal_inputs(valid)
        inv_freq = rope_inv_freq(self.config)
        x = self.model.embed_tokens(tokens)  # (B, T, E)
        graphdef, stacked = nnx.split(self.model.layers)

        def layer(x, state):  # forward only: nothing is kept for a backward pass
            if mesh is not None:
                x = constrain(x, (BATCH, None, None), mesh)
            x, _ = nnx.merge(graphdef, state)(x, positions, inv_freq, mask)
            return x, None

        x, _ = jax.lax.scan(layer, x, stacked)
        h = self.model.norm(x[jnp.arange(x.shape[0]), pool])  # (B, E): the norm is per token
        return self.score(h)[:, 0].astype(jnp.float32)


def pool_positions(tokens: np.ndarray, valid: np.ndarray, pad_id: int | None) -> np.ndarray:
    """(B,) the rightmost valid position whose token is not `pad_id` (transformers' pooling; None:
    the last valid position, as transformers scores a model without a pad id)."""
    real = valid if pad_id is None else valid & (tokens != pad_id)
    real = np.where(real.any(axis=1, keepdims=True), real, valid)  # a text of pad ids only: its last token
    return (np.arange(tokens.shape[1])[None, :] * real).argmax(axis=1).astype(np.int32)


def buckets(max_length: int) -> tuple[int, ...]:
    """The lengths a batch is padded to: powers of two from MIN_BUCKET, and max_length last."""
    out = [b for b in (MIN_BUCKET << i for i in range(32)) if b < max_length]
    return (*out, max_length)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _score(graphdef, params, tokens, valid, pool, mesh=None):
    return nnx.merge(graphdef, params)(tokens, valid, pool, mesh)


def score_lowered(graphdef, params, batch_size: int, length: int, placement=None):
    """The scoring program lowered for a (batch_size, length) batch on the placement's reference
    mesh (`params`: arrays or ShapeDtypeStructs laid out there): grpo_core.rl.aot's program."""
    mesh = None if placement is None else placement.reference

    def a(shape, dtype):
        sharding = None if placement is None else placement.batch_sharding(shape, mesh)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    b, t = batch_size, length
    return _score.lower(graphdef, params, a((b, t), jnp.int32), a((b, t), jnp.bool_), a((b,), jnp.int32), mesh)


def load_classifier(folder: str, dtype: str, placement=None, where: str = "") -> SequenceClassifier:
    """The classifier in `folder` (a local Hugging Face folder) with parameters and compute in
    `dtype`; with a `placement`, each parameter put onto its shards of the reference mesh as it is
    read (as the KL reference is laid out)."""
    hf, cfg_path = read_hf_config(folder)
    cfg = classifier_config(hf, f"{where} {cfg_path}".strip(), dtype=dtype, param_dtype=dtype)
    mesh = None if placement is None else placement.reference
    build = lambda: SequenceClassifier(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    return load_weights(folder, build, cfg.num_hidden_layers, placement, mesh)


class Scorer:
    """A loaded classifier and the jitted program that scores token rows with it, in batches of
    `batch_size` rows of at most `max_length` tokens (callers cut longer rows)."""

    def __init__(
        self, model: SequenceClassifier, batch_size: int, max_length: int, pad_id: int, pool_pad_id, placement
    ):
        self.graphdef, self.params = nnx.split(model)
        self.config = model.config
        self.batch_size, self.max_length = batch_size, max_length
        self.pad_id, self.pool_pad_id = pad_id, pool_pad_id
        self.placement = placement
        self.mesh = None if placement is None else placement.reference

    def batch(self, rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, valid, pool) of up to batch_size rows: left-padded to their length bucket, and
        padded with empty rows to batch_size (one program per bucket)."""
        longest = max((len(r) for r in rows), default=1)
        t = next(b for b in buckets(self.max_length) if b >= longest)
        tokens = np.full((self.batch_size, t), self.pad_id, np.int32)
        valid = np.zeros((self.batch_size, t), bool)
        for i, r in enumerate(rows):
            if r:
                tokens[i, t - len(r) :] = r
                valid[i, t - len(r) :] = True
        return tokens, valid, pool_positions(tokens, valid, self.pool_pad_id)

    def __call__(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """(len(rows),) f32 scores. A host sync per batch: the scores go to the reward sum."""
        out = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            arrays = self.batch(chunk)
            if self.placement is not None:
                arrays = self.placement.put_batch(arrays, self.mesh)
            scores = _score(self.graphdef, self.params, *arrays, self.mesh)
            out.append(np.asarray(to_host(scores))[: len(chunk)])
        return np.concatenate(out) if out else np.zeros(0, np.float32)


# Scorers by (folder, dtype, batch_size, max_length): the training and evaluation rewards of a run
# name the same model (eval.rewards empty: the training rewards made again), and a worker that
# stays for the next stage keeps its weights (grpo_core.stages.ahead)
_OPEN: dict[tuple[Any, ...], Scorer] = {}


def open_scorer(
    folder: str, dtype: str, batch_size: int, max_length: int, pad_id: int, pool_pad_id, placement=None, where=""
) -> Scorer:
    key = (folder, dtype, batch_size, max_length)
    found = _OPEN.get(key)
    if found is not None and found.placement is not placement and placement is not None:
        found.params = placement.put_params(found.params, placement.reference)  # no copy where laid out alike
        found.placement, found.mesh = placement, placement.reference
    if found is None:
        model = load_classifier(folder, dtype, placement, where)
        found = _OPEN[key] = Scorer(model, batch_size, max_length, pad_id, pool_pad_id, placement)
        n = sum(math.prod(x.shape) for x in jax.tree.leaves(found.params))
        log.info("reward model %s: %.1f M parameters in %s on %s", folder, n / 1e6, dtype, found.mesh or "one device")
    return found
