"""Benchmark: one GRPO step of the engine on two Qwen3-shaped f32 workloads, and LoRA.

    python -m bench.grpo_step [--workload small|tiny|small-lora|all] [--steps N] [--json out.json] [--profile]

Both workloads: tied embeddings, vocab 384, 8 prompts of 8-10 tokens, 8 completions each forced
to 32 tokens (EOS ignored), temperature 1, beta = 0.04 (reference model on), num_iterations 1,
AdamW with gradient clipping at 1.0. "small": hidden 512, 8 layers, 8/4 heads, head_dim 64,
intermediate 1408. "tiny": hidden 128, 2 layers, 4/2 heads, head_dim 32, intermediate 256.
"small-lora": "small" with rank-8 LoRA adapters (alpha 16) on every linear of each layer: only
the adapters train, the reference is the base with adapters off; compared with "small" (full
fine-tuning) of the same run, also by optimizer-state size. Its FLOP/s are not reported (the
model-FLOP formula is full fine-tuning's).

Each workload runs in its own process (so peak memory is its own). Reported: first-step time
(compilation included), then medians over N steps of wall and CPU seconds (all threads), the
split rollout / rewards / reference / update, rollout tokens/s, peak RSS, and achieved model
FLOP/s against this machine's f32 matmul peak measured at the start of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# On a GPU the parent (the matmul peak) and each workload's process would otherwise each reserve
# most of its memory up front; allocate on demand so they fit side by side.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

WORKLOADS = {"small": dict(steps=5), "tiny": dict(steps=20), "small-lora": dict(steps=5, preset="small", lora=8)}
REFERENCE = {  # measured on this kind of machine with the same settings (issue 2)
    "small": {"TRL 1.16": 6.2, "Tunix 0.1.7": 9.9, "EasyDeL 0.3": 11.2, "target": 4.5},
    "tiny": {"TRL 1.16": 0.23, "Tunix 0.1.7": 0.35, "target": 0.08},
}
PROMPTS, GENERATIONS, NEW_TOKENS = 8, 8, 32


def matmul_peak_gflops() -> float:
    """Best f32 GFLOP/s of a jitted square matmul (1024 and 2048), after a warm-up."""
    import jax
    import jax.numpy as jnp

    best = 0.0
    for n in (1024, 2048):
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        f = jax.jit(lambda x: x @ x)
        f(a).block_until_ready()
        for _ in range(5):
            t = time.perf_counter()
            f(a).block_until_ready()
            best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best


def model_flops(
    cfg, prompt_lens: list[int], generations: int = GENERATIONS, new_tokens: int = NEW_TOKENS
) -> dict[str, float]:
    """Model FLOPs of one step from real (unpadded) lengths; padding shows up as lost utilisation.

    Per token, a forward costs 2 * (matmul params + LM head) plus attention 4 * H * D * context
    per layer. Rollout: each prompt prefilled once, then G rows x (N - 1) decode steps per prompt.
    Reference: one forward of prompts (once per group) and completions, logits at the N completion
    positions. Update: 3x the reference forward (forward + backward; recomputation under remat
    is not model FLOPs).
    """
    h, d, L = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers  # noqa: N806  (L: layers, as in the formula)
    mm = L * (h * cfg.num_attention_heads * d * 2 + 2 * h * cfg.num_key_value_heads * d + 3 * h * cfg.intermediate_size)
    head = cfg.vocab_size * h
    attn = lambda ctx: 4 * L * cfg.num_attention_heads * d * ctx  # QK^T and PV for one query

    def forward(tokens_ctx, logits_tokens):
        return sum(2 * mm + attn(c) for c in tokens_ctx) + 2 * head * logits_tokens

    g, n = generations, new_tokens
    prefill = forward([c for p in prompt_lens for c in range(1, p + 1)], len(prompt_lens))
    decode = forward(
        [p + t for p in prompt_lens for _ in range(g) for t in range(1, n)], g * len(prompt_lens) * (n - 1)
    )
    score = forward(
        [c for p in prompt_lens for c in range(1, p + 1)]
        + [p + t for p in prompt_lens for _ in range(g) for t in range(1, n)],
        g * len(prompt_lens) * n,
    )
    return {"rollout": prefill + decode, "reference": score, "update": 3 * score}


class RandomPrompts:
    """8-10 random characters per prompt, a pure function of (step, round)."""

    def __init__(self, alphabet: str):
        self.alphabet = list(alphabet)

    def sample(self, step: int, round_: int, n: int):
        import numpy as np

        rng = np.random.default_rng([step, round_])
        return [{"prompt": "".join(rng.choice(self.alphabet, size=int(rng.integers(8, 11))))} for _ in range(n)]


def frac_a(prompts, completions, **_):
    return [c.count("a") / max(len(c), 1) for c in completions]


def run_workload(name: str, steps: int, profile: bool = False) -> dict:
    import jax

    from grpo_core.config.memory import peak_rss_bytes
    from grpo_core.config.presets import get_preset
    from grpo_core.config.train import GRPOConfig, OptimizerConfig, SamplingConfig, TrainConfig
    from grpo_core.data.synthetic import CharTokenizer
    from grpo_core.nn.model import create_model
    from grpo_core.rewards.functions import Reward
    from grpo_core.rl.trainer import GRPOTrainer

    w = WORKLOADS[name]
    mcfg = get_preset(
        w.get("preset", name), vocab_size=384, tie_word_embeddings=True, dtype="float32", param_dtype="float32"
    )
    cfg = TrainConfig(
        grpo=GRPOConfig(num_generations=GENERATIONS, prompts_per_step=PROMPTS, beta=0.04, num_iterations=1),
        sampling=SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True),
        optimizer=OptimizerConfig(learning_rate=1e-5, max_grad_norm=1.0),
        num_steps=steps + 1,
    )
    tok = CharTokenizer()
    prompts = RandomPrompts(tok.chars)
    model = create_model(mcfg, 0)
    if w.get("lora"):
        from grpo_core.nn import lora

        lora.apply(model, lora.LoraConfig(rank=w["lora"], alpha=2.0 * w["lora"]))
    tr = GRPOTrainer(model, cfg, tok, [Reward(frac_a)], prompts)
    opt_mib = sum(x.nbytes for x in jax.tree.leaves(tr.state["opt_state"])) / 2**20
    trained_m = sum(x.size for x in jax.tree.leaves(tr.state["params"])) / 1e6
    t = time.perf_counter()
    tr.train_step()
    first = time.perf_counter() - t
    per_step = []
    for _ in range(steps):
        c = time.process_time()
        m = tr.train_step()
        m["cpu_s"] = time.process_time() - c
        per_step.append(m)
    prof = None
    if profile:  # one more step, after the timed ones
        from bench import profile as xprof

        with xprof.capture() as cap:
            tr.train_step()
        prof = cap.summary()
    med = lambda k: statistics.median(m[k] for m in per_step)
    lens = [len(r["prompt"]) for s in range(1, steps + 1) for r in prompts.sample(s, 0, PROMPTS)]
    flops = model_flops(mcfg, lens[:PROMPTS])  # every step has 8 prompts of 8-10 tokens: use one step's
    total = sum(flops.values())
    return {
        "workload": name,
        "params_m": mcfg.num_params() / 1e6,
        "first_step_s": first,
        "step_s": med("time/step"),
        "cpu_s": med("cpu_s"),
        "rollout_s": med("time/rollout"),
        "rewards_s": med("time/rewards"),
        "reference_s": med("time/reference"),
        "update_s": med("time/update"),
        "rollout_tokens_per_s": med("rollout_tokens_per_s"),
        "peak_rss_mib": peak_rss_bytes() / 2**20,  # VmHWM: ru_maxrss would carry this process's parent's peak
        "model_gflop_per_step": total / 1e9,
        "gflops": None if w.get("lora") else total / med("time/step") / 1e9,
        "trained_m": trained_m,
        "opt_state_mib": opt_mib,
        "steps": [
            {k: m[k] for k in ("time/step", "cpu_s", "time/rollout", "time/reference", "time/update")} for m in per_step
        ],
        **({"profile": prof} if prof is not None else {}),
    }


def _table(peak: float, rows: list[dict]) -> str:
    cols = [
        ("workload", "{:<10}"),
        ("params_m", "{:>8.2f}"),
        ("first_step_s", "{:>8.2f}"),
        ("step_s", "{:>8.3f}"),
        ("cpu_s", "{:>8.3f}"),
        ("rollout_s", "{:>8.3f}"),
        ("rewards_s", "{:>8.4f}"),
        ("reference_s", "{:>8.3f}"),
        ("update_s", "{:>8.3f}"),
        ("rollout_tokens_per_s", "{:>9.0f}"),
        ("peak_rss_mib", "{:>8.0f}"),
        ("opt_state_mib", "{:>8.2f}"),
        ("gflops", "{:>8.1f}"),
        ("pct_peak", "{:>7.1f}"),
    ]
    heads = [
        "workload",
        "params M",
        "first s",
        "step s",
        "CPU s",
        "rollout",
        "rewards",
        "ref",
        "update",
        "roll t/s",
        "peak MiB",
        "opt MiB",
        "GFLOP/s",
        "% peak",
    ]
    out = [
        f"f32 matmul peak on this machine: {peak:.1f} GFLOP/s (measured in this run)",
        "",
        " ".join(
            f"{h:>{len(fmt.format(0) if 'f' in fmt else fmt.format('x'))}}" if i else f"{h:<10}"
            for i, (h, (_, fmt)) in enumerate(zip(heads, cols))
        ),
    ]
    for r in rows:
        r = dict(r, pct_peak=None if r["gflops"] is None else 100 * r["gflops"] / peak)
        out.append(" ".join(f"{'-':>{len(fmt.format(0))}}" if r[k] is None else fmt.format(r[k]) for k, fmt in cols))
    out.append("")
    by = {r["workload"]: r for r in rows}
    for r in rows:
        if WORKLOADS[r["workload"]].get("lora"):
            base = by.get(WORKLOADS[r["workload"]]["preset"])
            line = (
                f"{r['workload']}: median {r['step_s']:.3f} s/step, {r['trained_m']:.2f} M trained parameters, "
                f"optimizer state {r['opt_state_mib']:.2f} MiB"
            )
            if base:
                line += (
                    f"; full fine-tuning of the same run {base['step_s']:.3f} s/step "
                    f"({base['step_s'] / r['step_s']:.2f}x the time), {base['opt_state_mib']:.1f} MiB "
                    f"({base['opt_state_mib'] / r['opt_state_mib']:.0f}x), peak RSS {base['peak_rss_mib']:.0f} "
                    f"vs {r['peak_rss_mib']:.0f} MiB"
                )
            out.append(line)
            continue
        refs = REFERENCE[r["workload"]]
        cmp = ", ".join(f"{k} {v} s (ours {v / r['step_s']:.2f}x faster)" for k, v in refs.items() if k != "target")
        out.append(f"{r['workload']}: median {r['step_s']:.3f} s/step vs {cmp}; target {refs['target']} s")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    ap.add_argument("--steps", type=int, help="timed steps after the first (default: 5 small, 20 tiny)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--profile", action="store_true", help="one more step under XLA's profiler: print its top ops by device time"
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:  # one workload in this process; print its JSON
        print(json.dumps(run_workload(args.workload, args.steps, args.profile)))
        return 0
    peak = matmul_peak_gflops()
    rows = []
    for name in WORKLOADS if args.workload == "all" else [args.workload]:
        steps = args.steps or WORKLOADS[name]["steps"]
        proc = subprocess.run(
            [sys.executable, "-m", "bench.grpo_step", "--child", "--workload", name, "--steps", str(steps)]
            + (["--profile"] if args.profile else []),
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(_table(peak, rows))
    for r in rows:
        if "profile" in r:
            from bench import profile as xprof

            print(f"\n{r['workload']}, one step:\n" + xprof.table(r["profile"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"matmul_peak_gflops": peak, "workloads": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
