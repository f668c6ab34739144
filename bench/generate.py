"""Benchmark: generation throughput of the engine's sampler (the GRPO rollout path) against
transformers' `generate`, on the same weights.

    python -m bench.generate [--workload small|tiny] [--batch 1 8 64] [--new-tokens 64]
                             [--calls N] [--temperature T] [--json out.json]

The model is bench.grpo_step's workload (default "small": Qwen3-shaped, vocab 384, hidden 512,
8 layers, 23.7 M parameters, f32), random weights written once with save_hf_model. Each batch
size B gets B prompts of 16 random token ids (no padding, attention mask all ones) and
generates 64 new tokens per row with EOS ignored, so every row runs the full length; temperature
1 over the whole softmax (no top-k / top-p) by default, greedy with --temperature 0.
  ours          load_hf_model, then grpo_core.rl.sampler.generate (jitted prefill + while_loop decode
                over a preallocated KV cache, SamplingConfig(ignore_eos=True)); the tokens are
                copied to the host, as the rollout does.
  transformers  AutoModelForCausalLM.from_pretrained(dtype=torch.float32) on the GPU when torch sees one, else CPU, then
                model.generate(attention_mask=..., max_new_tokens=min_new_tokens=64,
                do_sample=True, top_k=0, top_p=1) under torch.no_grad().
Each engine runs in its own process (ours with JAX's persistent compilation cache off). Reported
per batch size: the first call (ours: prefill and decode compilation included), the median of N
further calls, new tokens/s = B * 64 / median, and ours / transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ENGINES = ("ours", "transformers")
PROMPT_LEN = 16


def prompts(batch: int, vocab: int):
    """The same B x 16 token ids in both processes."""
    import numpy as np

    return np.random.default_rng(batch).integers(1, vocab, (batch, PROMPT_LEN)).astype(np.int32)


def _timed(call, calls: int) -> dict:
    t = time.perf_counter()
    call(0)
    first = time.perf_counter() - t
    times = []
    for i in range(1, calls + 1):
        t = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t)
    return {"first_s": first, "median_s": statistics.median(times), "times_s": times}


def run_ours(
    workload: str, folder: str, batches: list[int], new_tokens: int, calls: int, temperature: float
) -> list[dict]:
    """Write the workload's model to `folder`, load it back and time grpo_core.rl.sampler.generate."""
    import jax
    import numpy as np
    from flax import nnx

    from bench.hf_load import model_config
    from grpo_core.config.train import SamplingConfig
    from grpo_core.nn.hf import load_hf_model, save_hf_model
    from grpo_core.nn.model import create_model
    from grpo_core.rl.sampler import SamplerOptions, generate, pad_prompts, step_key

    cfg = model_config(workload)
    save_hf_model(create_model(cfg, 0), folder)
    graphdef, params = nnx.split(load_hf_model(folder))
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=temperature, ignore_eos=True)
    opts = SamplerOptions.from_config(sampling, [], pad_id=0)
    rows = []
    for b in batches:
        tokens, valid = pad_prompts([list(p) for p in prompts(b, cfg.vocab_size)], sampling.prompt_buckets, 0)
        assert tokens.shape == (b, PROMPT_LEN), tokens.shape  # no padding: same work as transformers

        def call(i):
            out = np.asarray(generate(graphdef, params, tokens, valid, step_key(0, i), opts).tokens)  # host sync
            assert out.shape == (b, new_tokens), out.shape

        rows.append(dict(engine="ours", batch=b, device=jax.default_backend(), **_timed(call, calls)))
    return rows


def run_transformers(
    workload: str, folder: str, batches: list[int], new_tokens: int, calls: int, temperature: float
) -> list[dict]:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the accelerator ours runs on, where there is one
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().to(device)
    sample = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    )
    rows = []
    for b in batches:
        ids = torch.from_numpy(prompts(b, model.config.vocab_size)).long().to(device)

        def call(i):
            torch.manual_seed(i)
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    pad_token_id=0,
                    eos_token_id=None,
                    **sample,
                ).cpu()
            assert out.shape == (b, PROMPT_LEN + new_tokens), out.shape

        rows.append(
            dict(
                engine="transformers",
                batch=b,
                device=device,
                torch_threads=torch.get_num_threads(),
                **_timed(call, calls),
            )
        )
    return rows


def _child(engine: str, args, folder: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # first call = compile
    cmd = [
        sys.executable,
        "-m",
        "bench.generate",
        "--child",
        engine,
        "--folder",
        folder,
        "--workload",
        args.workload,
        "--new-tokens",
        str(args.new_tokens),
        "--calls",
        str(args.calls),
        "--temperature",
        str(args.temperature),
        "--batch",
        *map(str, args.batch),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    )
    if proc.returncode != 0:
        raise RuntimeError(f"bench.generate --child {engine} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(args, params_m: float, rows: list[dict]) -> str:
    threads = next((r["torch_threads"] for r in rows if "torch_threads" in r), "?")
    devices = {r["engine"]: r.get("device", "?") for r in rows}
    out = [
        f"workload {args.workload} ({params_m:.1f} M params, f32): {PROMPT_LEN}-token prompts, {args.new_tokens} new "
        f"tokens per row (EOS ignored), temperature {args.temperature}; median of {args.calls} calls; "
        f"torch threads {threads}; ours on {devices.get('ours')}, transformers on {devices.get('transformers')}",
        "",
        f"{'batch':>5} {'engine':<12} {'first s':>8} {'median s':>8} {'tokens/s':>9}",
    ]
    out += [
        f"{r['batch']:>5} {r['engine']:<12} {r['first_s']:>8.2f} {r['median_s']:>8.3f} {r['tokens_per_s']:>9.0f}"
        for r in rows
    ]
    out.append("")
    by = {(r["engine"], r["batch"]): r for r in rows}
    for b in args.batch:
        o, t = by[("ours", b)], by[("transformers", b)]
        out.append(
            f"batch {b}: ours {o['tokens_per_s']:.0f} tokens/s vs transformers {t['tokens_per_s']:.0f} "
            f"({o['tokens_per_s'] / t['tokens_per_s']:.2f}x); first call {o['first_s']:.2f} s vs {t['first_s']:.2f} s"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=["small", "tiny"], default="small")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--calls", type=int, default=5, help="timed calls after the first, per batch size")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run = run_ours if args.child == "ours" else run_transformers
        print(json.dumps(run(args.workload, args.folder, args.batch, args.new_tokens, args.calls, args.temperature)))
        return 0
    from bench.hf_load import model_config

    with tempfile.TemporaryDirectory(prefix="bench-generate-") as folder:
        rows = [r for e in ENGINES for r in _child(e, args, folder)]  # ours first: it writes the folder
    for r in rows:
        r["tokens_per_s"] = r["batch"] * args.new_tokens / r["median_s"]
    params_m = model_config(args.workload).num_params() / 1e6
    rows.sort(key=lambda r: (r["batch"], ENGINES.index(r["engine"])))
    print(_table(args, params_m, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "workload": args.workload,
                    "params_m": params_m,
                    "prompt_len": PROMPT_LEN,
                    "new_tokens": args.new_tokens,
                    "temperature": args.temperature,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
