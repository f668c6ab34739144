"""Benchmark: the bytes a decode token step moves, against the floor, where it compiles.

    python -m bench.decode_bytes [--shape gpu-0.5b|small] [--target local v5e:1x1 ...] [--dtype bfloat16]
                                 [--top 6] [--json out.json]

A token step has to read the weights once and the KV cache filled so far once; everything else it
reads or writes is excess. For each target this compiles the sampler's prefill and decode
(grpo_core.generate.sampler, the programs a run executes) for one chip: the local backend, or a
TPU chip through XLA's TPU compiler ahead of time (libtpu, no TPU needed). It reads the compiled
module with grpo_core.rl.hlo_cost, which counts the layer loop as many times as it runs (XLA's
cost_analysis() counts a loop's body once), and reports per token step:

  bytes      what the decode loop's body reads and writes, op by op (a fusion is one op)
  floor      the weights' bytes + the live KV cache's: the slots filled at the mean step of a
             full-length completion (prompt bucket + N/2), in the cache's dtype
  x floor    bytes / floor; `x full` against the weights + every cache slot (what a step that
             attends to all slots, masked, must read)
  xla once   XLA's own cost_analysis() of the program, each loop body once, against this
             reader's figure counted the same way (`xla/once`): 1.0 on CPU; XLA:TPU's cost model
             counts up to 3-5x the logical bytes of small loop-free programs

and the ops that move the most, with the JAX op each came from. Shapes (random weights, forced
full-length completions; nothing runs, nothing is allocated):
  gpu-0.5b  Qwen2.5-0.5B (vocabulary 151,936), 8 prompts x 8 completions x 512 tokens, a
            128-token prompt bucket: the shape bench.real_shapes' gpu-0.5b runs
  small     a 4-layer trunk (hidden 256, bf16) with a 4,096-token vocabulary, 4 x 4 x 64 tokens
            (tests/test_decode_bytes.py keeps its ratio in CI)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SHAPES = {
    "gpu-0.5b": dict(preset="qwen2.5-0.5b", over={}, prompts=8, samples=8, prompt_len=128, new_tokens=512),
    "small": dict(
        preset="small",
        over={
            "vocab_size": 4096,
            "hidden_size": 256,
            "num_hidden_layers": 4,
            "intermediate_size": 704,
            "dtype": "bfloat16",
            "param_dtype": "bfloat16",
        },
        prompts=4,
        samples=4,
        prompt_len=32,
        new_tokens=64,
    ),
}


def _nbytes(tree) -> int:
    import jax
    import numpy as np

    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def measure(shape: str, target: str = "local", dtype: str | None = None, top: int = 6) -> dict:
    """One shape on one target (`local`, or a TPU topology of one chip such as `v5e:1x1`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from grpo_core.config.presets import get_preset
    from grpo_core.config.train import SamplingConfig
    from grpo_core.generate import sampler
    from grpo_core.nn.model import create_model, init_kv_cache
    from grpo_core.rl import hlo_cost

    s = SHAPES[shape]
    over = dict(s["over"])
    if dtype:
        over.update(dtype=dtype, param_dtype=dtype)
    mc = get_preset(s["preset"], **over)
    if target == "local":
        device = jax.devices()[0]
    else:
        from grpo_core.config.target import Target
        from grpo_core.rl.aot import topology_devices

        t = Target.parse(target, field="--target")
        if t.chips != 1:
            raise SystemExit(f"--target {target}: one chip (v5e:1x1, v6e:1x1); grpo check --target takes a slice")
        device = topology_devices(t)[0]
    one = SingleDeviceSharding(device)
    graph, params = nnx.split(nnx.eval_shape(lambda: create_model(mc, 0)))
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), params)
    p, g, tp, n = s["prompts"], s["samples"], s["prompt_len"], s["new_tokens"]
    sampling = SamplingConfig(max_new_tokens=n, prompt_buckets=(tp,))
    opts = sampler.SamplerOptions.from_config(sampling, (0,), 0, **sampler.backend_defaults(device.platform))
    lay = lambda shp, dt: jax.ShapeDtypeStruct(shp, dt, sharding=one)
    ptok, pval = lay((p, tp), jnp.int32), lay((p, tp), jnp.bool_)
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=one)
    compiled = sampler.compile_jobs(graph, params, ptok, pval, key, opts, g)[-1]()  # as a run compiles it
    cache = jax.eval_shape(lambda: init_kv_cache(mc, p * g, tp + n))
    a = hlo_cost.analyse(compiled.as_text())
    chunk = max(1, opts.decode_chunk)
    steps = sampler.phase_steps(opts)
    mean, step_ops = a.weighted(steps) if len(a.iterations) == len(steps) else (a.per_iteration, a.ops_per_iteration)
    step = mean.bytes / chunk
    weights, kv = _nbytes(params), _nbytes(cache)
    slots = tp + n
    live = kv * (tp + n / 2) / slots
    xla = compiled.cost_analysis()
    xla = (xla[0] if isinstance(xla, (list, tuple)) else xla) or {}
    merged: dict[tuple, list[float]] = {}  # one op of each phase's loop body as one op
    for o in step_ops:
        m = merged.setdefault((o.what, o.shape, o.source), [0.0, 0.0])
        m[0] += o.bytes * o.count
        m[1] += o.count
    ops = sorted(merged.items(), key=lambda kv: -kv[1][0])
    return {
        "shape": shape,
        "target": target if target != "local" else f"local ({device.platform})",
        "device_kind": device.device_kind,
        "dtype": mc.dtype.value,
        "rows": p * g,
        "new_tokens": n,
        "prompt_len": tp,
        "layers_unrolled": opts.unroll_layers,
        "weights_bytes": weights,
        "kv_cache_bytes": kv,
        "live_kv_bytes": live,
        "floor_bytes": weights + live,
        "step_bytes": step,
        "x_floor": step / (weights + live),
        "x_full": step / (weights + kv),
        "step_flops": mean.flops / chunk,
        "decode_loops": len(a.iterations),
        "outside_loop_bytes": a.once.bytes,
        "xla_once_bytes": float(xla.get("bytes accessed", 0.0)),
        "once_bytes": hlo_cost.once_each(compiled.as_text()).bytes,
        "top_ops": [
            {"bytes": b / chunk, "runs": round(runs / chunk, 3), "op": what, "shape": shp, "source": src}
            for (what, shp, src), (b, runs) in ops[:top]
        ],
    }


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f}"


def table(rows: list[dict]) -> str:
    head = ("shape", "target", "dtype", "floor MB", "bytes MB", "x floor", "x full", "xla once MB", "xla/once")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['shape']} | {r['target']} | error: {r['error']}")
            continue
        lines.append(
            " | ".join(
                (
                    r["shape"],
                    r["target"],
                    r["dtype"],
                    _mb(r["floor_bytes"]),
                    _mb(r["step_bytes"]),
                    f"{r['x_floor']:.2f}",
                    f"{r['x_full']:.2f}",
                    _mb(r["xla_once_bytes"]),
                    f"{r['xla_once_bytes'] / r['once_bytes']:.2f}",
                )
            )
        )
    for r in rows:
        if "error" in r:
            continue
        lines.append(f"\n{r['shape']} on {r['target']} ({r['dtype']}): the ops that move the most per token step")
        for o in r["top_ops"]:
            runs = f"x{o['runs']:g}" if o["runs"] != 1 else ""
            what = f"{o['op'][:44]:44} {o['shape'][:34]:34} {o['source'][-48:]}"
            lines.append(f"  {_mb(o['bytes']):>9} MB {runs:>4}  {what}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_bytes", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs="+", default=["gpu-0.5b"], choices=sorted(SHAPES))
    ap.add_argument("--target", nargs="+", default=["local", "v5e:1x1"], help="local, or a one-chip TPU topology")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="the model's dtype (default: the shape's)")
    ap.add_argument("--top", type=int, default=6, help="ops listed per row")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    if any(t != "local" for t in args.target):  # libtpu as a compiler only, before JAX loads it
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    rows = []
    for shape in args.shape:
        for target in args.target:
            try:
                rows.append(measure(shape, target, args.dtype, args.top))
            except Exception as exc:  # noqa: BLE001 - one row's failure is that row's result
                rows.append({"shape": shape, "target": target, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"measured {shape} on {target}", file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
