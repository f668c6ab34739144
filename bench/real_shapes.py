"""Benchmark: GRPO steps at real vocabulary and completion lengths: peak memory against the
preflight's estimate, the memory floor and s/step, under each rematerialisation policy.

    python -m bench.real_shapes [--workload a|b|gpu-0.5b|...|all] [--remat auto|none|dots|full|all]
                                [--accum auto|N] [--steps N] [--json out.json] [--profile [--profile-dir DIR]]

Workloads (random weights, random 8-10 character prompts, completions forced to N tokens, β 0.04,
train.grpo.grad_accum_steps: auto unless --accum, log-probs in chunks of the default size):
  a         the `small` trunk (hidden 512, 8 layers) with Qwen's vocabulary (151,936; tied, f32,
            101 M parameters), 4 prompts x 8 completions x 128 tokens
  b         the `qwen3-0.6b` preset (bf16 parameters and compute), 2 prompts x 8 x 256 tokens
  gpu-0.5b  Qwen2.5-0.5B's shape in bf16, 8 prompts x 8 x 512 tokens: for a GPU or TPU (the
            update's MFU against the chip's bf16 peak); on CPU only with --workload gpu-0.5b
  gpu-1.5b  the same with Qwen2.5-1.5B's shape, where memory binds on an 80 GB GPU
  a-rm      shape (a) with a reward model of the same trunk (rewards[].model: random, f32), scoring
            batches of 8 texts of 512 tokens (each text padded to max_length: the plan's worst case)
  a-rm-long the same, its batches 8 x 2048 tokens: scoring is the step's peak
  a-short   shape (a) cut to 4 layers, 2 x 4 x 32 tokens; small, tiny: bench.grpo_step's workloads
            (vocabulary 384, 8 x 8 x 32): quick checks of the estimate (tests/test_memory.py)

Each (workload, remat) runs in a fresh process, so its peak is its own. What a setting leaves at
auto is chosen as a run's worker chooses it: on an accelerator (or under GRPO_DEVICE_MEMORY_BYTES)
by the backend's compiler (grpo_core.rl.compiler_plan: XLA's memory_analysis of each candidate
update against the device's memory), else by the memory plan's formula. Reported: that choice
and the plan's estimate for it; the peak resident set of the process (VmHWM: weights,
compiled programs, compilation itself and the runtime, everything the host must hold) and, on an
accelerator, the device's peak bytes in use; the floor (params + gradients + optimizer state +
reference + KV cache, the bytes no policy can avoid); estimate / peak; the first step (compilation
included) and the median of the timed steps, with the rollout / reference / update split; rollout
tokens/s; on an accelerator, the update's model FLOP/s as a share of its bf16 peak (MFU).
--profile: one more step under XLA's profiler, and a table of the ops that took the most device
time (bench.profile). GRPO_ATTENTION and GRPO_DECODE_CHUNK (see docs/gpu.md) apply as in a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from grpo_core.config.target import DEVICE_KIND, PEAK_BF16_FLOPS  # JAX-free

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the device's real peak, not a pool

WORKLOADS = {
    "a": dict(
        preset="small",
        over={"vocab_size": 151936, "dtype": "float32", "param_dtype": "float32"},
        prompts=4,
        generations=8,
        new_tokens=128,
        steps=2,
    ),
}
WORKLOADS |= {  # "a" with a reward model of the policy's shape: texts of 512 and 2048 tokens, 8 a batch
    "a-rm": dict(WORKLOADS["a"], reward_model=(8, 512)),
    "a-rm-long": dict(WORKLOADS["a"], reward_model=(8, 2048)),
    "b": dict(preset="qwen3-0.6b", over={}, prompts=2, generations=8, new_tokens=256, steps=1),
    "gpu-0.5b": dict(preset="qwen2.5-0.5b", over={}, prompts=8, generations=8, new_tokens=512, steps=3, gpu=True),
    "gpu-1.5b": dict(preset="qwen2.5-1.5b", over={}, prompts=8, generations=8, new_tokens=512, steps=3, gpu=True),
    "a-short": dict(
        preset="small",
        over={"vocab_size": 151936, "num_hidden_layers": 4, "dtype": "float32", "param_dtype": "float32"},
        prompts=2,
        generations=4,
        new_tokens=32,
        steps=1,
    ),
    "small": dict(
        preset="small",
        over={"vocab_size": 384, "dtype": "float32", "param_dtype": "float32"},
        prompts=8,
        generations=8,
        new_tokens=32,
        steps=3,
    ),
    "tiny": dict(
        preset="tiny",
        over={"vocab_size": 384, "dtype": "float32", "param_dtype": "float32"},
        prompts=8,
        generations=8,
        new_tokens=32,
        steps=5,
    ),
}
REMATS = ("auto", "none", "dots", "full")
# bf16 dense peak FLOP/s per chip, by device_kind prefix; the TPUs' from grpo_core.config.target
# (Cloud TPU pages), "TPU v5 lite" (v5e) before "TPU v5" (v5p)
BF16_PEAK = {
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
    "NVIDIA L4": 121e12,
    **{DEVICE_KIND[gen]: peak for gen, peak in PEAK_BF16_FLOPS.items()},
}
PROMPT_TOKENS = 10  # RandomPrompts draws 8-10 characters


def run(
    name: str, remat: str, steps: int, profile: bool = False, profile_dir: str | None = None, accum: str = "auto"
) -> dict:
    """One workload under one remat setting (and train.grpo.grad_accum_steps `accum`), in this
    process. `profile`: one more step after the timed ones, under XLA's profiler (bench.profile),
    its top ops in the result."""
    import jax

    from bench.grpo_step import RandomPrompts, frac_a, model_flops
    from grpo_core.config import memory
    from grpo_core.config.presets import get_preset
    from grpo_core.config.train import GRPOConfig, OptimizerConfig, SamplingConfig, TrainConfig
    from grpo_core.data.synthetic import CharTokenizer
    from grpo_core.nn.model import create_model
    from grpo_core.rewards.functions import Reward
    from grpo_core.rl import compiler_plan
    from grpo_core.rl.trainer import GRPOTrainer

    w = WORKLOADS[name]
    facts = memory.device_facts()  # before any array: the runtime term is the process alone
    mcfg = get_preset(w["preset"], **w["over"])
    train = TrainConfig(
        grpo=GRPOConfig(
            num_generations=w["generations"],
            prompts_per_step=w["prompts"],
            beta=0.04,
            grad_accum_steps=accum if accum == "auto" else int(accum),
        ),
        sampling=SamplingConfig(max_new_tokens=w["new_tokens"], ignore_eos=True),
        optimizer=OptimizerConfig(learning_rate=1e-6),
        num_steps=steps + 1,
        remat=remat,
    )
    # as the worker does: on an accelerator (or under GRPO_DEVICE_MEMORY_BYTES) what is left at
    # auto is chosen by this backend's compiler, the formula plans the choice
    choice = compiler_plan.choose(mcfg, train, PROMPT_TOKENS)
    if choice is not None:
        train = compiler_plan.resolve(train, choice)
        print(f"memory: {choice['describe']}", file=sys.stderr, flush=True)
    rm_shapes, rewards, placement = (), [Reward(frac_a)], None
    if "reward_model" in w:  # a reward model of the same trunk, as a run's rewards[].model scores
        rm_shapes, rewards, placement = _reward_model(mcfg, train, *w["reward_model"])
    plan = memory.plan_on(mcfg, train, PROMPT_TOKENS, facts, reward_models=rm_shapes)
    tok = CharTokenizer()
    prompts = RandomPrompts(tok.chars)
    tr = GRPOTrainer(create_model(mcfg, 0), train, tok, rewards, prompts, memory_plan=plan, placement=placement)
    t = time.perf_counter()
    tr.train_step()
    first = time.perf_counter() - t
    per = [tr.train_step() for _ in range(steps)]
    prof = None
    if profile:
        from bench import profile as xprof

        with xprof.capture(profile_dir) as cap:
            tr.train_step()
        prof = cap.summary()
    med = lambda k: statistics.median(m[k] for m in per)
    e = plan.estimate
    floor = sum(e.terms[k] for k in ("params", "gradients", "optimizer", "reference", "kv_cache"))
    out = {
        "workload": name,
        "remat_asked": remat,
        "accum_asked": accum,
        "remat": e.remat.value,
        "grad_accum_steps": e.grad_accum_steps,
        "logits_chunk_mib": e.chunk_mib,
        "backend": facts["backend"],
        "device_kind": jax.devices()[0].device_kind,
        "params_m": mcfg.num_params() / 1e6,
        "estimate_bytes": e.total,
        "floor_bytes": floor,
        "estimate_terms": e.terms,
        "peak_phase": e.peak_phase,
        "runtime_bytes": facts["runtime"],
        "available_bytes": facts["available"],
        "fits": plan.fits,
        "peak_rss_bytes": memory.peak_rss_bytes(),
        "first_step_s": first,
        "step_s": med("time/step"),
        "rollout_s": med("time/rollout"),
        "reference_s": med("time/reference"),
        "rescore_s": med("time/rescore"),  # a pass of its own; 0 where the update's forward scores old_logp
        "update_s": med("time/update"),
        "rollout_tokens_per_s": med("rollout_tokens_per_s"),
        "attention": os.environ.get("GRPO_ATTENTION", "auto"),
        "decode_chunk": tr.opts.decode_chunk,
        "chosen_by": "formula" if choice is None else "xla",
    }
    if choice is not None:
        out["xla_choice"] = {k: choice[k] for k in ("peak_bytes", "usable_bytes", "candidates", "seconds", "describe")}
    if prof is not None:
        out["profile"] = prof
    peak = memory.peak_bytes()
    if "peak_device_bytes" in peak:
        out["peak_device_bytes"] = peak["peak_device_bytes"]
        kind = jax.devices()[0].device_kind
        chip = next((v for k, v in BF16_PEAK.items() if kind.startswith(k)), None)
        lens = [len(r["prompt"]) for r in prompts.sample(1, 0, w["prompts"])]
        update = model_flops(mcfg, lens, w["generations"], w["new_tokens"])["update"]
        out["update_tflops"] = update / out["update_s"] / 1e12
        out["mfu"] = None if chip is None else update / out["update_s"] / (chip * jax.device_count())
    return out


def _reward_model(mcfg, train, batch_size: int, max_length: int):
    """(its shape for the plan, the rewards, the placement): a random classifier of `mcfg`'s trunk on
    the run's reference mesh, scoring each (prompt, completion) as a text of max_length tokens."""
    from flax import nnx

    from grpo_core.config.memory import RewardModelShape
    from grpo_core.nn.reward_model import Scorer, SequenceClassifier
    from grpo_core.rewards.functions import Reward
    from grpo_core.runtime.mesh import Placement

    placement = Placement.from_config(train.mesh)
    model = SequenceClassifier(mcfg, rngs=nnx.Rngs(1))
    model = nnx.merge(nnx.graphdef(model), placement.put_params(nnx.state(model), placement.reference))
    scorer = Scorer(model, batch_size, max_length, 0, None, placement)
    vocab = mcfg.vocab_size

    def reward_model(prompts, completions, completion_ids, **_):
        rows = [([ord(c) % vocab for c in p] + list(ids))[-max_length:] for p, ids in zip(prompts, completion_ids)]
        return scorer([[1] * (max_length - len(r)) + r for r in rows]).tolist()

    shape = RewardModelShape(mcfg, batch_size, max_length, "reward_model")
    return (shape,), [Reward(reward_model, name="reward_model", model=True)], placement


def _table(rows: list[dict]) -> str:
    g = lambda b: f"{b / 2**30:.2f}"
    head = (
        "workload",
        "remat",
        "accum",
        "estimate GiB",
        "peak GiB",
        "est/peak",
        "floor GiB",
        "first s",
        "s/step",
        "rollout",
        "ref",
        "rescore",
        "update",
        "roll tok/s",
    )
    out = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        peak = r.get("peak_device_bytes") or r["peak_rss_bytes"]
        chooser = "XLA" if r.get("chosen_by") == "xla" else "formula"
        remat = r["remat"] + (f" (auto: {chooser})" if r["remat_asked"] == "auto" else "")
        out.append(
            " | ".join(
                [
                    r["workload"],
                    remat,
                    str(r["grad_accum_steps"]),
                    g(r["estimate_bytes"]),
                    g(peak),
                    f"{r['estimate_bytes'] / peak:.2f}",
                    g(r["floor_bytes"]),
                    f"{r['first_step_s']:.1f}",
                    f"{r['step_s']:.2f}",
                    f"{r['rollout_s']:.2f}",
                    f"{r['reference_s']:.2f}",
                    f"{r.get('rescore_s', 0.0):.2f}",
                    f"{r['update_s']:.2f}",
                    f"{r['rollout_tokens_per_s']:.0f}",
                ]
            )
        )
    out.append("")
    for r in rows:
        where = "device" if "peak_device_bytes" in r else "process RSS"
        line = (
            f"{r['workload']} remat={r['remat']}: {r['params_m']:.0f} M params on {r['backend']} "
            f"({r['device_kind']}); peak {where} {g(r.get('peak_device_bytes') or r['peak_rss_bytes'])} GiB, "
            f"estimate {g(r['estimate_bytes'])} GiB (peak phase {r['peak_phase']}, runtime {g(r['runtime_bytes'])})"
        )
        if r.get("mfu") is not None:
            line += f"; update {r['update_tflops']:.1f} TFLOP/s = {100 * r['mfu']:.1f} % MFU"
        out.append(line)
        if "xla_choice" in r:
            out.append(f"  memory: {r['xla_choice']['describe']}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--workload", choices=[*WORKLOADS, "all"], default="all", help="all: a and b (and gpu-0.5b on an accelerator)"
    )
    ap.add_argument("--remat", choices=[*REMATS, "all"], default="auto", help="all: auto, then each policy")
    ap.add_argument("--accum", default="auto", help="train.grpo.grad_accum_steps: auto (default) or a number")
    ap.add_argument("--steps", type=int, help="timed steps after the first (default: per workload)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--profile", action="store_true", help="one more step under XLA's profiler: print its top ops by device time"
    )
    ap.add_argument("--profile-dir", help="with --profile: keep the trace (.xplane.pb) here, for XProf/TensorBoard")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run(args.workload, args.remat, args.steps, args.profile, args.profile_dir, args.accum)))
        return 0
    names = [args.workload] if args.workload != "all" else ["a", "b"] + (["gpu-0.5b"] if _accelerator() else [])
    remats = REMATS if args.remat == "all" else (args.remat,)
    rows, root = [], os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in names:
        for remat in remats:
            steps = args.steps or WORKLOADS[name]["steps"]
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.real_shapes",
                    "--child",
                    "--workload",
                    name,
                    "--remat",
                    remat,
                    "--steps",
                    str(steps),
                    "--accum",
                    args.accum,
                ]
                + (["--profile"] if args.profile else [])
                + (["--profile-dir", os.path.join(args.profile_dir, f"{name}-{remat}")] if args.profile_dir else []),
                capture_output=True,
                text=True,
                cwd=root,
            )
            if proc.returncode != 0:
                why = "killed by the kernel (out of memory?)" if proc.returncode == -9 else f"exit {proc.returncode}"
                print(f"{name} remat={remat}: {why}\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(_table(rows[-1:]).splitlines()[2], flush=True)  # progress: this row
    print()
    print(_table(rows))
    for r in rows:
        if "profile" in r:
            from bench import profile as xprof

            print(f"\n{r['workload']} remat={r['remat']}, one step:\n" + xprof.table(r["profile"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0 if rows else 1


def _accelerator() -> bool:
    """Whether JAX sees a GPU or TPU, asked in a child so that this process holds no device."""
    code = "import jax; print(jax.devices()[0].platform)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip() in ("gpu", "tpu")


if __name__ == "__main__":
    sys.exit(main())
