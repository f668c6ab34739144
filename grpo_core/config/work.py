"""Work as a whole: the tokens one training step, or one evaluation batch, may generate and train.

Each factor has a limit of its own for a deployment run (`api_max` on its field), but the limits
multiply: `prompts_per_step 4096`, `num_generations 256` and `max_new_tokens 32768`, each at its own
limit, ask for 3.4e10 tokens a step together. A total is the product a config asks for, declared
here with its limit (one host's worth, which the operator raises with `grpo serve --raise-limit
NAME=N` as a field's); the trust policy (grpo_core.rewards.trust) refuses a deployment run over
it, naming the product and its factors. The local user's own config is not bounded by it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# (dotted field, value) of each factor: a product of counts times a sum of lengths
Factors = tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]


@dataclasses.dataclass(frozen=True)
class WorkTotal:
    name: str  # what --raise-limit names
    doc: str
    api_max: int
    counts: tuple[str, ...]  # dotted fields multiplied
    lengths: tuple[str, ...]  # dotted fields summed, the sum multiplied by the counts

    def factors(self, cfg: Any) -> Factors:
        """The factors' values in `cfg` (a RunConfig)."""
        return tuple((f, int(_value(cfg, f))) for f in self.counts), tuple(
            (f, int(_value(cfg, f))) for f in self.lengths
        )

    def of(self, cfg: Any) -> int:
        counts, lengths = self.factors(cfg)
        total = sum(v for _, v in lengths)
        for _, v in counts:
            total *= v
        return total

    def formula(self) -> str:
        """How the total is computed, for the docs: a × b × (c + d)."""
        return " × ".join([*(f"`{f}`" for f in self.counts), "(" + " + ".join(f"`{f}`" for f in self.lengths) + ")"])

    def spelled(self, cfg: Any) -> str:
        """The product with `cfg`'s values, for a message: P 4096 × G 256 × (prompt 256 + new 32768) = ..."""
        counts, lengths = self.factors(cfg)
        parts = [f"{f} {v:,}" for f, v in counts]
        parts.append("(" + " + ".join(f"{f} {v:,}" for f, v in lengths) + ")")
        return " × ".join(parts) + f" = {self.of(cfg):,} tokens"


TOTALS = (
    WorkTotal(
        "train.tokens_per_step",
        "Tokens one training step may generate and train: prompts × completions per prompt × (prompt + new tokens)",
        1 << 23,
        ("train.grpo.prompts_per_step", "train.grpo.num_generations"),
        ("data.max_prompt_tokens", "train.sampling.max_new_tokens"),
    ),
    WorkTotal(
        "eval.tokens_per_batch",
        "Tokens one evaluation batch may generate: prompts × samples per prompt × (prompt + new tokens)",
        1 << 23,
        ("eval.batch_size", "eval.num_samples"),
        ("data.max_prompt_tokens", "train.sampling.max_new_tokens"),
    ),
)


def _value(cfg: Any, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj
