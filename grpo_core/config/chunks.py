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
# On an accelerator a chunk may exceed the budget up to this factor to be a power of two that divides
# the vocabulary (Qwen's 151,936 = 2^7 x 1187: 128 chunks)
MAX_OVER_BUDGET = 4


def num_chunks(vocab: int, tokens: int, chunk_mib: int = DEFAULT_CHUNK_MIB, backend: str = "cpu") -> int:
    """How many vocabulary chunks one (tokens x V/k) f32 logits chunk is cut into.

    CPU: the least count that keeps a chunk within chunk_mib, or a divisor of the vocabulary up to
    twice that (no padding). GPU and TPU: a power of two that divides the vocabulary, the least
    within the budget, else the largest when its chunks exceed the budget at most MAX_OVER_BUDGET
    times. There a padded head is copied on every call, and a power-of-two count of lane-aligned
    chunks compiles faster (a TPU update of Qwen2.5-0.5B: 128 chunks 103.6 CPU-s, 149 padded 141.8).
    A vocabulary with too few factors of two takes the CPU rule."""
    least = min(vocab, max(1, math.ceil(tokens * vocab * 4 / (chunk_mib * 2**20))))
    if backend != "cpu":
        twos = vocab & -vocab  # the largest power of two dividing the vocabulary
        if twos >= least:
            return 1 << (least - 1).bit_length()
        if twos * MAX_OVER_BUDGET >= least:
            return twos
    return next((k for k in range(least, min(2 * least, vocab) + 1) if vocab % k == 0), least)
