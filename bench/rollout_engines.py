"""Benchmark: rollout tokens/s of each engine on bench/grpo_step.py's workload, and weight-sync time.

    python -m bench.rollout_engines [--calls N] [--json out.json]

The workload of bench/grpo_step.py: 8 prompts of 8-10 random characters, 8 completions each
forced to 32 tokens (EOS ignored), temperature 1, the "small" Qwen3-shaped f32 policy (hidden
512, 8 layers, vocab 384, tied embeddings). sglang-jax's CPU attention needs head_dim 128, so
the engines are compared on "small-hd128": 4 query / 2 k/v heads of 128 instead of 8 / 4 of 64
(the same parameter count and FLOPs); the built-in sampler also runs the original shape.

Each engine runs in its own process: `jax` here, `sglang` (in process) in the .venv-sglang
interpreter, `http` here against a sglang-jax server it starts on 127.0.0.1. Reported per
engine: rollout tokens/s (the median over N calls after warm-up calls, which compile), their
ratio to the built-in sampler on the same shape, start-up time, and the weight-sync time (jax:
none; sglang: in-memory assignment of new weights, median over 5; http: export + server
restart, median over 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPTS, GENERATIONS, NEW_TOKENS = 8, 8, 32
SHAPES = {"small": {}, "small-hd128": {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128}}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup(shape: str):
    from flax import nnx

    from bench.grpo_step import RandomPrompts
    from grpo_core.config.presets import get_preset
    from grpo_core.data.synthetic import CharTokenizer
    from grpo_core.nn.model import create_model
    from grpo_core.rl.sampler import SamplerOptions, pad_prompts

    tok = CharTokenizer()
    mcfg = get_preset(
        "small", vocab_size=384, tie_word_embeddings=True, dtype="float32", param_dtype="float32", **SHAPES[shape]
    )
    graphdef, params = nnx.split(create_model(mcfg, 0))
    rows = RandomPrompts(tok.chars).sample(1, 0, PROMPTS)
    ptok, pval = pad_prompts([tok.encode(r["prompt"]) for r in rows], (16,), tok.pad_token_id)
    opts = SamplerOptions(NEW_TOKENS, 1.0, 0, 1.0, (), tok.pad_token_id)  # ignore_eos: every row 32 tokens
    return tok, mcfg, graphdef, params, ptok, pval, opts


def _perturbed(params, i: int):
    import jax

    return jax.tree.map(lambda p: p * (1.0 + 1e-3 * (i + 1)), params)


def run_engine(engine_name: str, shape: str, calls: int, warm: int) -> dict:
    import jax

    from grpo_core.config.train import RolloutConfig
    from grpo_core.engines import make_engine
    from grpo_core.rl.sampler import step_key

    tok, mcfg, graphdef, params, ptok, pval, opts = _setup(shape)
    b = PROMPTS * GENERATIONS
    # context_length = the longest prompt bucket + 32: sglang-jax's CPU (native) attention gathers
    # every row's whole context for each query, so its cost grows with rows x context_length.
    knobs = {"disable_precompile": True, "max_total_tokens": 4096, "context_length": 64, "start_timeout_s": 900}
    cfg = {
        "jax": RolloutConfig(),
        "sglang": RolloutConfig(engine="sglang", **knobs),
        "http": RolloutConfig(engine="http", server="sglang-jax", api="sglang", **knobs),
    }[engine_name]
    t = time.perf_counter()
    engine = make_engine(
        cfg, graphdef=graphdef, params_fn=lambda: params, model_config=mcfg, opts=opts, batch_size=b, tokenizer=tok
    )
    out = {"engine": engine_name, "shape": shape, "python": sys.version.split()[0], "jax": jax.__version__}
    try:
        syncs = [engine.sync(params, 0)]  # http: the first export and server start
        out["start_s"] = time.perf_counter() - t
        for i in range(warm):
            engine.generate(ptok, pval, step_key(0, 1000 + i), GENERATIONS)
        times, tokens = [], 0
        for i in range(calls):
            t = time.perf_counter()
            g = engine.generate(ptok, pval, step_key(0, i), GENERATIONS)
            times.append(time.perf_counter() - t)
            tokens = int(g.lengths.sum())
        assert tokens == b * NEW_TOKENS, tokens
        out.update(
            tokens_per_call=tokens,
            call_s=statistics.median(times),
            tokens_per_s=tokens / statistics.median(times),
            call_s_all=[round(x, 4) for x in times],
        )
        if engine_name != "jax":
            n = 5 if engine_name == "sglang" else 2
            for i in range(n):
                new = jax.block_until_ready(_perturbed(params, i))  # ready before the clock starts
                syncs.append(engine.sync(new, i + 1))
            out.update(
                first_sync_s=syncs[0], sync_s=statistics.median(syncs[1:]), sync_s_all=[round(x, 4) for x in syncs]
            )
            t = time.perf_counter()
            engine.generate(ptok, pval, step_key(0, 99), GENERATIONS)  # the first call after a sync
            out["call_after_sync_s"] = time.perf_counter() - t
    finally:
        engine.close()
    return out


def _child(engine: str, shape: str, calls: int, warm: int) -> dict:
    from grpo_core.launch.processes import sglang_python

    python = sys.executable
    if engine == "sglang":
        python = sglang_python()
        if python is None:
            return {"engine": engine, "shape": shape, "skipped": "no .venv-sglang (make sglang-env)"}
    elif engine == "http" and sglang_python() is None:
        return {"engine": engine, "shape": shape, "skipped": "no .venv-sglang (make sglang-env)"}
    cmd = [
        python,
        "-m",
        "bench.rollout_engines",
        "--child",
        engine,
        "--shape",
        shape,
        "--calls",
        str(calls),
        "--warm",
        str(warm),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=1800
    )
    if proc.returncode != 0:
        return {"engine": engine, "shape": shape, "error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(rows: list[dict]) -> str:
    base = {r["shape"]: r["tokens_per_s"] for r in rows if r["engine"] == "jax" and "tokens_per_s" in r}
    out = [
        f"{'engine':<8} {'shape':<12} {'python':<8} {'tok/s':>8} {'vs jax':>7} {'call s':>7} {'start s':>8} "
        f"{'sync s':>8} {'1st sync':>8}"
    ]
    for r in rows:
        if "tokens_per_s" not in r:
            out.append(
                f"{r['engine']:<8} {r['shape']:<12} {r.get('skipped') or 'FAILED: ' + r.get('error', '')[-300:]}"
            )
            continue
        ratio = r["tokens_per_s"] / base[r["shape"]] if r["shape"] in base else float("nan")
        sync = f"{r['sync_s']:>8.4f}" if "sync_s" in r else f"{'-':>8}"
        first = f"{r['first_sync_s']:>8.3f}" if "first_sync_s" in r else f"{'-':>8}"
        out.append(
            f"{r['engine']:<8} {r['shape']:<12} {r['python']:<8} {r['tokens_per_s']:>8.0f} {ratio:>6.2f}x "
            f"{r['call_s']:>7.3f} {r['start_s']:>8.2f} {sync} {first}"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=10, help="timed rollouts per engine")
    ap.add_argument("--warm", type=int, default=3, help="untimed rollouts first (they compile)")
    ap.add_argument("--engines", default="jax,sglang,http")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="small-hd128", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_engine(args.child, args.shape, args.calls, args.warm)))
        return 0
    plan = [("jax", "small")] + [(e, "small-hd128") for e in args.engines.split(",")]
    rows = [_child(e, s, args.calls, args.warm) for e, s in plan]
    print(f"workload: {PROMPTS} prompts x {GENERATIONS} completions x {NEW_TOKENS} tokens, T=1, f32, CPU")
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "workload": {"prompts": PROMPTS, "generations": GENERATIONS, "new_tokens": NEW_TOKENS},
                    "engines": rows,
                },
                f,
                indent=1,
            )
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
