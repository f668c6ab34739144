"""Benchmark: the learner's share of a step where it rescores the sampler's log-probs (bf16
compute, the sglang and http engines): a scoring pass of its own then the update, against the
update that takes old_logp from its own forward (one update per rollout, the default).

    python -m bench.rescore [--workload small|real-vocab|tiny|all] [--reps N] [--json out.json]

Workloads (random weights, random 8-10 character prompts, completions forced to N tokens, f32 with
train.rollout.recompute_logprobs on: the same code path as bf16, at the CPU's matmul speed; token
truncation of the mismatch weights at 2.0, beta 0):
  small       bench.grpo_step's `small` (hidden 512, 8 layers, vocabulary 384), 8 prompts x 8 x 32
  real-vocab  the `small` trunk cut to 4 layers with Qwen's vocabulary (151,936), 4 prompts x 8 x 64
  tiny        the `tiny` preset, 2 prompts x 4 x 8: a check that the benchmark runs (not in `all`)

Both variants run on one trainer's rollout batch, in this process, each call on a fresh copy of
the state (the update donates it). Reported: the first call (compilation included: two programs
apart, one in the update), the median of N calls, and apart / in-update. The loss of both is
printed too: they agree (tests/test_loss_variants.py pins it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

WORKLOADS = {
    "small": dict(preset="small", over={}, prompts=8, generations=8, new_tokens=32),
    "real-vocab": dict(
        preset="small", over={"vocab_size": 151936, "num_hidden_layers": 4}, prompts=4, generations=8, new_tokens=64
    ),
    "tiny": dict(preset="tiny", over={}, prompts=2, generations=4, new_tokens=8),
}


def run(name: str, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from bench.grpo_step import RandomPrompts, frac_a
    from grpo_core.config.presets import get_preset
    from grpo_core.config.train import (
        GRPOConfig,
        ISCorrection,
        OptimizerConfig,
        RematPolicy,
        RolloutConfig,
        SamplingConfig,
        TrainConfig,
    )
    from grpo_core.data.synthetic import CharTokenizer
    from grpo_core.nn.model import create_model
    from grpo_core.rewards.functions import Reward
    from grpo_core.rl.learner import Learner
    from grpo_core.rl.trainer import GRPOTrainer, _rollout_weights

    w = WORKLOADS[name]
    mcfg = get_preset(w["preset"], dtype="float32", param_dtype="float32", **w["over"])
    train = TrainConfig(
        grpo=GRPOConfig(num_generations=w["generations"], prompts_per_step=w["prompts"], beta=0.0, grad_accum_steps=1),
        sampling=SamplingConfig(max_new_tokens=w["new_tokens"], ignore_eos=True),
        optimizer=OptimizerConfig(learning_rate=1e-6),
        rollout=RolloutConfig(recompute_logprobs=True),
        num_steps=2,
        remat=RematPolicy.NONE,
    )
    tok = CharTokenizer()
    tr = GRPOTrainer(create_model(mcfg, 0), train, tok, [Reward(frac_a)], RandomPrompts(tok.chars))
    assert tr.rescore_in_update and tr.is_mode is ISCorrection.TOKEN_TRUNCATE
    ro, _ = tr.rollout(0)
    batch = tr._batch(ro)
    inside = tr.learner
    hp = dataclasses.replace(inside.hp, rescore_in_update=False, is_mode=ISCorrection.OFF)
    apart = Learner(tr.graphdef, train.optimizer, hp, 2, None, tr.placement)
    fresh = lambda: jax.tree.map(jnp.copy, tr.state)

    def call_apart(state):
        behaviour = apart.score_policy(tr.params, batch)
        weights, _ = _rollout_weights(behaviour, batch.old_logp, batch.mask, tr.is_mode, train.rollout.is_cap)
        return apart.update(state, batch._replace(old_logp=behaviour, rollout_weight=weights))

    def call_inside(state):
        return inside.update(state, batch)

    out = {"workload": name, "vocab": mcfg.vocab_size, "rows": batch.targets.shape[0], "tokens": w["new_tokens"]}
    for variant, call in (("apart", call_apart), ("in_update", call_inside)):
        times, loss = [], None
        for i in range(reps + 1):
            state = fresh()
            jax.block_until_ready(state)
            t = time.perf_counter()
            _, metrics = call(state)
            loss = float(jax.block_until_ready(metrics["loss"]))
            times.append(time.perf_counter() - t)
        out[variant] = {"first_s": times[0], "median_s": statistics.median(times[1:]), "loss": loss}
    out["ratio"] = out["apart"]["median_s"] / out["in_update"]["median_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="all", choices=[*WORKLOADS, "all"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    names = ["small", "real-vocab"] if args.workload == "all" else [args.workload]
    rows = [run(n, args.reps) for n in names]
    head = ("workload", "vocab", "rows x tokens", "variant", "first s", "median s", "loss")
    print("{:<11} {:>7} {:>13} {:<10} {:>8} {:>9} {:>10}".format(*head))
    for r in rows:
        for v in ("apart", "in_update"):
            x = r[v]
            shape = f"{r['rows']} x {r['tokens']}"
            print(
                f"{r['workload']:<11} {r['vocab']:>7} {shape:>13} {v:<10} {x['first_s']:>8.2f} {x['median_s']:>9.3f}"
                f" {x['loss']:>10.3e}"
            )
        print(f"{'':<11} apart / in_update: {r['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
