"""Check an sglang-jax environment against the built-in sampler, in a process of its own:

    .venv-sglang/bin/python -m grpo_core.stages.engine_selftest [--train-steps N] [--json out.json]

Run it with the sglang-jax interpreter (an internal engine error ends the whole process, so
the tests start it as a child). On one small Qwen3-shaped policy (head_dim 128: sglang-jax's
CPU attention needs it) it checks that

- greedy completions through the in-process engine equal the built-in sampler's, token for
  token, with and without a stop token, and their log-probs agree;
- a weight sync changes the outputs as it should: after syncing other weights the engine
  matches the sampler on those, and syncing the first weights back restores the first outputs;
- sampled completions (T = 0.7, top-k) are reproducible from the step key, and their log-probs
  are the learner's softmax(logits / T) ones;
- a LoRA policy synced as the trainer syncs it (adapters merged into the kernels) generates
  what the sampler generates with the adapters on;
- with --train-steps N, GRPOTrainer trains N steps with train.rollout.engine=sglang, the engine
  synced to every step.

Prints one JSON report (and writes it to --json); exit 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

from grpo_core.config.model import ModelConfig
from grpo_core.config.train import RolloutConfig
from grpo_core.engines.sglang import SglangEngine
from grpo_core.nn import lora
from grpo_core.nn.model import create_model
from grpo_core.rl.learner import score_completions
from grpo_core.rl.sampler import SamplerOptions, generate, pad_prompts, step_key
from grpo_core.rl.trainer import GRPOTrainer
from grpo_core.testing import SYNTHETIC_DEFAULT, build_synthetic

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def policy_config(**overrides):
    fields = dict(
        vocab_size=64,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        intermediate_size=512,
        tie_word_embeddings=False,
        qk_norm=True,
        max_position_embeddings=512,
        rope_theta=10_000.0,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def peaked_policy(cfg, seed: int):
    """A random policy whose matrices are scaled up, so greedy decoding has clear winners
    (near-ties would let two correct implementations pick different tokens)."""

    graphdef, params = nnx.split(create_model(cfg, seed))
    return graphdef, jax.tree.map(lambda p: p * 6.0 if p.ndim >= 2 else p, params)


def _prompts(cfg, pad_id: int):
    rows = [[5, 9, 11, 3], [17, 4], [30, 31, 32, 33, 34, 35]]
    return pad_prompts(rows, (8,), pad_id)


def _check(report: dict, name: str, ok: bool, **detail) -> None:
    report["checks"][name] = bool(ok)
    if detail:
        report.setdefault("detail", {})[name] = detail


def parity(report: dict, max_new_tokens: int = 12) -> None:
    cfg = policy_config()
    graphdef, params_a = peaked_policy(cfg, 0)
    _, params_b = peaked_policy(cfg, 1)
    ptok, pval = _prompts(cfg, pad_id=0)
    g = 2
    greedy = SamplerOptions(max_new_tokens, 0.0, 0, 1.0, (), 0)

    def ours(params, opts, key=step_key(0, 0)):
        c = generate(graphdef, params, ptok, pval, key, opts, g)
        return jax.device_get((c.tokens, c.logprobs, c.lengths, c.truncated))

    rollout = RolloutConfig(
        engine="sglang",
        disable_precompile=True,
        max_total_tokens=4096,
        context_length=256,
        start_timeout_s=600,
        generate_timeout_s=300,
        sync_timeout_s=120,
    )
    t = time.perf_counter()
    engine = SglangEngine(rollout, cfg, greedy, batch_size=len(ptok) * g, seed=0)
    report["engine_start_s"] = round(time.perf_counter() - t, 3)
    try:

        def theirs(params=None, opts=None, key=step_key(0, 0)):
            if params is not None:
                engine.sync(params, len(engine.sync_times))
            engine.opts = opts or greedy
            out = engine.generate(ptok, pval, key, g)
            return out.tokens, out.logprobs, out.lengths, out.truncated

        ref_a, ref_b = ours(params_a, greedy), ours(params_b, greedy)
        got_a = theirs(params_a)
        same = lambda x, y: all(np.array_equal(u, v) for u, v in zip((x[0], x[2], x[3]), (y[0], y[2], y[3])))
        lp_diff = float(np.max(np.abs(got_a[1] - ref_a[1])))
        _check(
            report,
            "greedy_matches_sampler",
            same(got_a, ref_a) and lp_diff < 2e-3,
            logprob_max_abs_diff=lp_diff,
            engine=got_a[0].tolist(),
            sampler=ref_a[0].tolist(),
        )
        got_b = theirs(params_b)
        _check(
            report,
            "sync_changes_outputs",
            same(got_b, ref_b) and not np.array_equal(got_b[0], got_a[0]),
            engine=got_b[0].tolist(),
            sampler=ref_b[0].tolist(),
        )
        _check(report, "sync_back_restores", same(theirs(params_a), ref_a))

        # A stop token: the first token greedy row 0 emits after its first step.
        eos = int(ref_a[0][0][1])
        stop = SamplerOptions(max_new_tokens, 0.0, 0, 1.0, (eos,), 0)
        ref_s, got_s = ours(params_a, stop), theirs(None, stop)
        _check(
            report,
            "stop_token_matches",
            same(got_s, ref_s) and bool(np.any(~ref_s[3])),
            lengths=got_s[2].tolist(),
            sampler_lengths=ref_s[2].tolist(),
        )

        # Sampling: reproducible from the key; log-probs under softmax(logits / T), as the learner's.
        warm = SamplerOptions(max_new_tokens, 0.7, 20, 1.0, (), 0)
        k1, k2 = step_key(0, 1), step_key(0, 2)
        s1, s1b, s2 = theirs(None, warm, k1), theirs(None, warm, k1), theirs(None, warm, k2)
        _check(report, "sampling_reproducible", np.array_equal(s1[0], s1b[0]) and not np.array_equal(s1[0], s2[0]))
        batch = {"prompt_tokens": ptok, "prompt_valid": pval, "targets": s1[0]}
        learner = np.asarray(score_completions(graphdef, params_a, batch, 0.7, backend=jax.default_backend()))
        mask = np.arange(max_new_tokens)[None, :] < s1[2][:, None]
        diff = float(np.max(np.abs(np.where(mask, learner - s1[1], 0.0))))
        _check(report, "sampled_logprobs_are_learners", diff < 2e-3, max_abs_diff=diff)
        report["weight_sync_s"] = [round(x, 5) for x in engine.sync_times]

        # LoRA: the trainer syncs the merged weights (W + scale A B); the engine must then
        # generate what the sampler generates with the adapters on.
        lgd, lparams = lora_policy(graphdef, params_a)
        ref_l = jax.device_get(generate(lgd, lparams, ptok, pval, step_key(0, 0), greedy, g).tokens)

        merged = nnx.state(lora.merge(nnx.merge(lgd, lparams)), nnx.Param)
        got_l = theirs(merged)
        _check(report, "lora_merged_sync", np.array_equal(got_l[0], ref_l) and not np.array_equal(ref_l, ref_a[0]))
    finally:
        engine.close()


def lora_policy(graphdef, params):
    """The policy with LoRA adapters whose B is non-zero, so they change the outputs."""

    model = lora.apply(nnx.merge(graphdef, params), lora.LoraConfig(rank=4, alpha=8.0))
    adapters = nnx.state(model, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(adapters))))
    nnx.update(model, jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype) * 0.3, adapters))
    return nnx.split(model)


def train(report: dict, steps: int) -> None:
    """A few GRPO steps of the synthetic task with the sglang engine (head_dim 128 policy)."""

    cfg = copy.deepcopy(SYNTHETIC_DEFAULT)
    cfg["model"].update(num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    cfg["train"].update(num_steps=steps)
    cfg["train"]["grpo"].update(prompts_per_step=4, num_generations=4)
    cfg["train"]["rollout"] = {
        "engine": "sglang",
        "disable_precompile": True,
        "max_total_tokens": 2048,
        "context_length": 128,
    }
    run = build_synthetic(cfg)
    tr = GRPOTrainer(run.model, run.train, run.tokenizer, run.rewards, run.task)
    try:
        hist, synced = [], []
        for _ in range(steps):
            hist.append(tr.train_step())
            synced.append(tr.engine.synced_step)
        report["train"] = [
            {k: round(m[k], 5) for k in ("reward", "loss", "ratio_mean", "time/rollout", "time/sync") if k in m}
            for m in hist
        ]
        ok = all(abs(m["ratio_mean"] - 1.0) < 1e-4 for m in hist) and all(s == i + 1 for i, s in enumerate(synced))
        _check(report, "training_steps", ok and len(hist) == steps, synced_steps=synced)
    finally:
        tr.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grpo_core.stages.engine_selftest", description=__doc__.split("\n")[0])
    ap.add_argument("--train-steps", type=int, default=0, help="also train this many GRPO steps with the engine")
    ap.add_argument("--skip-parity", action="store_true", help="only the training steps")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args(argv)
    report: dict = {"python": sys.version.split()[0], "checks": {}}
    t = time.perf_counter()
    if not args.skip_parity:
        parity(report)
    if args.train_steps:
        train(report, args.train_steps)
    report["seconds"] = round(time.perf_counter() - t, 2)
    report["ok"] = bool(report["checks"]) and all(report["checks"].values())
    text = json.dumps(report)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text, flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
