"""A reward model's scores here against transformers', for `grpo check` (where PyTorch is installed):

    python -m grpo_core.stages.reward_parity --model ID_OR_FOLDER [--field rewards[0].model]

Scores a few texts of different lengths, tokenized by the reward model's own tokenizer, with this
project's JAX classifier (grpo_core.nn.reward_model) and with transformers'
AutoModelForSequenceClassification, both in float32 on the CPU, batched as TRL batches them (right
padding and an attention mask for transformers); prints one JSON line: {"torch": false} where
PyTorch is not installed (nothing else is loaded then), else the scores and the largest difference.
Its own process: it loads the model twice, and JAX and PyTorch, none of which a training worker
should keep.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

TEXTS = (
    "What is 7 + 5? The answer is 12.",
    "Write a haiku about the sea.\nWaves fold into foam; the gulls argue with the wind; salt dries on the rocks.",
    "2 + 2 = 5",
    "Natalia sold 48 clips in April and half as many in May: 48 + 24 = 72 clips altogether. #### 72",
)
TOLERANCE = 1e-4  # float32, as the tests hold the tiny models


def compare(model: str, field: str = "rewards[].model") -> dict:
    if importlib.util.find_spec("torch") is None:
        return {"torch": False}
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a check, beside whatever holds the accelerators
    import numpy as np  # worker start: after JAX_PLATFORMS above
    import torch  # heavy: torch, only this check imports it
    from transformers import AutoModelForSequenceClassification  # heavy: transformers

    from grpo_core.config.run import RewardSpec  # worker start: after JAX_PLATFORMS above
    from grpo_core.rewards.reward_model import ModelReward  # worker start: after JAX_PLATFORMS above
    from grpo_core.store.sources import resolve  # worker start: after JAX_PLATFORMS above

    t = time.perf_counter()
    reward = ModelReward(RewardSpec(model=model), field).open(None, "float32")
    rows = reward.encode(TEXTS)
    ours = reward.scorer(rows)
    folder = resolve(model, None, weights=True, field=field)
    hf = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    theirs = transformers_scores(hf, rows, reward.scorer.pad_id)
    diff = float(np.abs(ours - theirs).max())
    return {
        "torch": True,
        "texts": len(TEXTS),
        "tokens": [len(r) for r in rows],
        "ours": [float(x) for x in ours],
        "transformers": [float(x) for x in theirs],
        "max_abs_diff": diff,
        "ok": diff <= TOLERANCE * max(1.0, float(np.abs(theirs).max())),
        "seconds": round(time.perf_counter() - t, 2),
    }


def transformers_scores(model, rows: list[list[int]], pad_id: int):
    """A transformers sequence classifier's scores of token `rows` as TRL computes them: one
    right-padded batch with its attention mask (float32 numpy)."""
    import torch  # heavy: only where PyTorch is installed

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, 0].float().numpy()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grpo_core.stages.reward_parity", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the reward model: a Hub id, a folder or a gs:// folder")
    ap.add_argument("--field", default="rewards[].model", help="the config field that names it (in messages)")
    args = ap.parse_args(argv)
    try:
        out = compare(args.model, args.field)
    except Exception as exc:  # noqa: BLE001 - the check reports what failed, naming it
        out = {"torch": True, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
