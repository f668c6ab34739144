"""Benchmark: the memory plan against XLA's TPU compiler, from this host (no TPU needed).

    python -m bench.aot [--model qwen2.5-0.5b ...] [--target v5e:2x2 ...] [--new-tokens 512] [--json out.json]

For each model and TPU topology: the update of 8 prompts x 8 completions x N tokens (β 0.04, Qwen's
vocabulary, bf16), AOT-compiled (grpo_core.rl.aot) with train.remat and
train.grpo.grad_accum_steps at auto, the compiler choosing (candidates cheapest first, the first
that fits); XLA's peak per chip (the program's peak plus the run's arrays that are not its
arguments, the KL reference); the formula's estimate (grpo_core.config.memory) for the same
choice and its ratio to XLA's; the compile time and the candidates compiled. Each row runs in
a process of its own, through grpo_core.stages.aot's cache: a second run prints at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

MODELS = ("qwen2.5-0.5b", "qwen3-0.6b", "qwen2.5-1.5b")
TARGETS = ("v5e:2x2", "v5e:2x4", "v4:2x2x1", "v6e:2x2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def request(model: str, target: str, new_tokens: int) -> dict:
    from grpo_core.config.presets import get_preset

    return {
        "model": get_preset(model).to_dict(),
        "train": {
            "grpo": {"num_generations": 8, "prompts_per_step": 8, "beta": 0.04},
            "sampling": {"max_new_tokens": new_tokens, "ignore_eos": True},
        },
        "max_prompt_tokens": 64,
        "target": target,
        "programs": ["update"],
    }


def row(model: str, target: str, new_tokens: int) -> dict:
    """One (model, target) in a child process: grpo_core.stages.aot's report."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(request(model, target, new_tokens), f)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "grpo_core.stages.aot", "--request", f.name],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
    finally:
        os.unlink(f.name)
    try:
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        report = {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    return {"model": model, "topology": target, "new_tokens": new_tokens, **report}


def formula_bytes(r: dict) -> int:
    """grpo_core.config.memory's estimate per chip for the row's choice of remat and accumulation."""
    from grpo_core.config import memory
    from grpo_core.config.presets import get_preset
    from grpo_core.config.train import RematPolicy, TrainConfig

    req = request(r["model"], r["topology"], r["new_tokens"])
    train = TrainConfig.from_dict(req["train"])
    layout = memory.Layout(*train.mesh.sizes(r["target"]["chips"]))
    return memory.estimate(
        get_preset(r["model"]),
        train,
        req["max_prompt_tokens"],
        remat=RematPolicy(r["remat"]),
        grad_accum_steps=r["grad_accum_steps"],
        layout=layout,
        backend="tpu",
    ).total


def _line(r: dict) -> str:
    g = lambda b: "-" if b is None else f"{b / 2**30:.2f}"
    if "error" in r:
        return f"{r['model']} | {r['topology']} | error: {r['error'][:200]}"
    u = r["programs"][0]
    tried = len(r["update_candidates"])
    formula = formula_bytes(r)  # today's formula (a cached report holds the one of its day)
    ratio = "-" if not u.get("peak_bytes") else f"{formula / u['peak_bytes']:.2f}"
    return " | ".join(
        [
            r["model"],
            r["target"]["topology"],
            r["mesh"].removeprefix("train "),
            f"{r['remat']} / {r['grad_accum_steps']}",
            g(u.get("xla_peak_bytes")),
            g(u.get("peak_bytes")),
            g(r["target"]["hbm_bytes"]),
            "yes" if u["fits"] else "NO",
            g(formula),
            ratio,
            f"{u['compile_s']:.0f}",
            f"{r['compile_s']:.0f} ({tried})" + (" cached" if r.get("cached") else ""),
        ]
    )


HEAD = (
    "model | target | mesh | remat / accum | XLA update GiB | chip peak GiB | HBM GiB | fits | formula GiB | "
    "formula/XLA | compile s | all compiles s (candidates)"
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", choices=MODELS, help="default: all three")
    ap.add_argument("--target", action="append", help="default: " + ", ".join(TARGETS))
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    print(HEAD)
    print(" | ".join("---" for _ in HEAD.split(" | ")), flush=True)
    for model in args.model or MODELS:
        for target in args.target or TARGETS:
            rows.append(row(model, target, args.new_tokens))
            print(_line(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
