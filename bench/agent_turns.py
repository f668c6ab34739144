"""Benchmark: what an episode's later turn costs the rollout, re-reading its conversation.

    python -m bench.agent_turns [--workload small|qwen-0.5b] [--rows 16] [--prompt 128]
                                [--new-tokens 64] [--turns 3] [--result 32] [--json out.json]

grpo_core.agent.episodes draws each later turn through the engine's own `generate`: the prompt and
every token so far are read again in one prefill (no KV cache is kept between turns, on any engine).
A cache kept across turns (the alternative) would save at most that re-read: the prefill of the
conversation up to the turn, less the new tokens (the last turn's result and header), which any
engine must read. This bench times, for turns 1..T of an episode at the shape given (B rows, a
prompt, `new_tokens` per turn, a `result` of tool tokens between turns), the turn's prefill and its
decode on this machine's default JAX backend, and prints the share of the turn's time the re-read
takes: the most a kept cache could save. `qwen-0.5b` is Qwen2.5-0.5B's shape (151,936-token
vocabulary, 24 layers; random weights, float32 on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

WORKLOADS = {"tiny": ("tiny", {}), "small": ("small", {}), "qwen-0.5b": ("qwen2.5-0.5b", {})}


def _time(fn, calls: int = 3) -> float:

    fn()  # compiles
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(workload: str, rows: int, prompt: int, new_tokens: int, turns: int, result: int) -> list[dict]:
    from grpo_core.config.presets import get_preset  # grpo_core first: it chooses JAX's platform
    from grpo_core.config.train import SamplingConfig
    from grpo_core.generate.sampler import SamplerOptions, decode, pad_prompts, prefill
    from grpo_core.nn.model import create_model

    preset, over = WORKLOADS[workload]
    import jax  # after grpo_core, as above
    import numpy as np
    from flax import nnx

    mc = get_preset(preset, **over)
    graphdef, params = nnx.split(create_model(mc, 0))
    buckets = SamplingConfig().prompt_buckets
    opts = SamplerOptions(new_tokens, 1.0, 0, 1.0, (), 0)
    rng = np.random.default_rng(0)
    out = []
    length = prompt
    for turn in range(1, turns + 1):
        ids = [rng.integers(1, mc.vocab_size, length).tolist() for _ in range(rows)]
        ptok, pval = pad_prompts(ids, buckets, 0)
        key = jax.random.key(turn)

        def pre():
            cache, state = prefill(graphdef, params, ptok, pval, key, opts=opts, num_samples=1)
            jax.block_until_ready(state)
            return cache, state

        def whole():
            cache, state = pre()
            _, c = decode(graphdef, params, cache, state, key, opts=opts, prompt_len=int(ptok.shape[1]))
            jax.block_until_ready(c.tokens)

        t_pre, t_all = _time(pre), _time(whole)
        reread = length - (prompt if turn == 1 else result)  # what a kept cache would not read again
        out.append(
            {
                "turn": turn,
                "prompt_tokens": length,
                "bucket": int(ptok.shape[1]),
                "prefill_s": t_pre,
                "decode_s": max(0.0, t_all - t_pre),  # two medians apart: noise may cross them at tiny shapes
                "reread_tokens": max(0, reread) if turn > 1 else 0,
                "reread_share": 0.0 if turn == 1 else min(1.0, t_pre * max(0, reread) / length / max(t_all, t_pre)),
            }
        )
        length += new_tokens + result
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.agent_turns")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="small")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--result", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    got = run(args.workload, args.rows, args.prompt, args.new_tokens, args.turns, args.result)
    import jax  # loaded by run

    print(
        f"{args.workload}: {args.rows} rows, a {args.prompt}-token prompt, {args.new_tokens} new tokens a turn, "
        f"{args.result}-token results; backend {jax.default_backend()}"
    )
    print(f"{'turn':>4} {'prompt':>7} {'bucket':>7} {'prefill s':>10} {'decode s':>9} {'re-read share':>14}")
    for r in got:
        print(
            f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['bucket']:>7} {r['prefill_s']:>10.3f} {r['decode_s']:>9.3f} "
            f"{r['reread_share']:>13.1%}"
        )
    later = [r for r in got if r["turn"] > 1]
    if later:
        share = sum(r["reread_share"] * (r["prefill_s"] + r["decode_s"]) for r in later) / sum(
            r["prefill_s"] + r["decode_s"] for r in later
        )
        print(f"a cache kept across turns would save at most {share:.1%} of the later turns' time here")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "turns": got}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
