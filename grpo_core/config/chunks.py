"""How the LM head's log-probs are split over the vocabulary (grpo_core.rl.logprobs computes them;
grpo_core.config.memory counts their working set): pure arithmetic, no JAX, so both sides of the
process boundary share one rule."""

from __future__ import annotations

import math

# Bytes of one chunk's f32 logits (train.logits_chunk_mib): 64 MiB measured fastest on CPU
# (32 MiB: 17.7 s, 64: 15.2 s, 256: 15.7 s in bench.grpo_step) and keeps the few chunk-sized
# buffers alive at once far below the weights of any model with a real vocabulary.
DEFAULT_CHUNK_MIB = 64
CHUNK_BUFFERS = 3  # (M, Vc) f32 buffers alive at once in a chunk's backward: logits, probabilities, their gradient


def num_chunks(vocab: int, tokens: int, chunk_mib: int = DEFAULT_CHUNK_MIB) -> int:
    """How many vocabulary chunks keep one chunk's f32 logits (tokens x V/k) within chunk_mib: a
    divisor of the vocabulary where one is near (no padding), else the least count."""
    least = min(vocab, max(1, math.ceil(tokens * vocab * 4 / (chunk_mib * 2**20))))
    return next((k for k in range(least, min(2 * least, vocab) + 1) if vocab % k == 0), least)
