"""Benchmark: reading a policy back from a run, as evaluation, export and a continual run
(model.init_from) do, and a resumed training stage its whole train state, at a real vocabulary.

    python -m bench.start_policy [--workload qwen3-vocab|qwen3-0.6b|tiny] [--repeats N] [--json out.json]

Workloads (random f32 weights, Qwen3-shaped): "qwen3-vocab" is qwen3-0.6b's vocabulary (151,936)
and width (1024) with 4 decoder layers (216 M parameters, 0.86 GB); "qwen3-0.6b" the whole preset
(596 M, 2.4 GB); "tiny" is for the tests. The build process writes one checkpoint as the trainer
lays it out (its train state: the parameters and Adam's two moments, grpo_core.rl.learner) and
the same parameters as a Hugging Face export (grpo_core.nn.hf.save_hf_model).

Each measurement is a fresh process that imports JAX and grpo_core first, then times:
  checkpoint, whole state   Checkpointer.restore(step): every array, moments included, as
                            policies were read before (the parameters then taken from it)
  checkpoint, params only   Checkpointer.restore(step, only="params"): Orbax's partial restore
  export (HF folder)        grpo_core.nn.hf.load_hf_model(export folder)
  policy, as evaluation     RunParts.policy_at(checkpoint, step): the policy evaluation and export
                            take, built as shapes and filled from the checkpoint's parameters
  policy, initialised first the same policy built as it was before: the preset initialised from
                            its seed (with model.path: its weights read), then overwritten
  train state, resumed      what a resumed training stage restores (the worker's train): the state
                            built as shapes (RunParts.policy_shapes, Learner.init_state) and
                            filled from the checkpoint, moments included
  train state, built first  the same state built as it was before: the policy initialised, its
                            moments zeroed, then every array overwritten
with the peak RSS above the process's RSS before reading (bench.hf_load.PeakMemory). Medians
over N processes; the page cache is warm (the files were just written).
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

WORKLOADS = ("qwen3-vocab", "qwen3-0.6b", "tiny")
MODES = ("whole", "params", "export", "policy", "policy-init", "resume", "resume-init")
LABELS = {
    "whole": "checkpoint, whole state",
    "params": "checkpoint, params only",
    "export": "export (HF folder)",
    "policy": "policy, as evaluation",
    "policy-init": "policy, initialised first",
    "resume": "train state, resumed",
    "resume-init": "train state, built first",
}
MIB = 2**20


def run_config(name: str):
    """The run config whose checkpoint the build writes (a preset; f32 throughout)."""
    from grpo_core.config.run import RunConfig

    model = {"preset": "qwen3-0.6b", "vocab_size": 151936, "dtype": "float32", "param_dtype": "float32"}
    if name == "qwen3-vocab":
        model["num_hidden_layers"] = 4
    if name == "tiny":
        model.update(preset="tiny", vocab_size=384)
    return RunConfig.from_dict({"model": model})


def learner(run, graphdef):
    """The learner a training worker builds for this run (its optimizer fixes the state's layout)."""
    from grpo_core.config.train import RematPolicy
    from grpo_core.rl.learner import Learner, LossParams
    from grpo_core.runtime.mesh import Placement

    hp = LossParams.from_config(run.train.grpo.replace(grad_accum_steps=1), 16, 1.0, RematPolicy.NONE)
    return Learner(graphdef, run.train.optimizer, hp, 100, placement=Placement.from_config(run.train.mesh))


def build(name: str, folder: str) -> dict:
    import jax
    from flax import nnx

    from grpo_core.nn.hf import save_hf_model
    from grpo_core.nn.model import create_model
    from grpo_core.rl.checkpoint import Checkpointer

    run = run_config(name)
    cfg = run.model_config()
    model = create_model(cfg, run.model.seed)
    graphdef, params = nnx.split(model)
    state = learner(run, graphdef).init_state(params)
    t = time.perf_counter()
    with Checkpointer(os.path.join(folder, "checkpoints"), max_to_keep=None) as ckpt:
        ckpt.save(7, state, {"seed": run.train.seed, "config_hash": run.train_hash})
        ckpt.wait()
    save_s = time.perf_counter() - t
    save_hf_model(model, os.path.join(folder, "export"))
    with open(os.path.join(folder, "workload"), "w") as f:
        f.write(name)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    return {"params_m": n / 1e6, "params_mib": 4 * n / MIB, "checkpoint_mib": 12 * n / MIB, "save_s": save_s}


def measure(mode: str, folder: str) -> dict:
    import jax
    from flax import nnx

    from bench.hf_load import PeakMemory, _release_free_heap
    from grpo_core.data.tokenizer import make_tokenizer
    from grpo_core.nn.hf import load_hf_model
    from grpo_core.rl.checkpoint import Checkpointer
    from grpo_core.stages.parts import RunParts, _unwrap

    with open(os.path.join(folder, "workload")) as f:
        cfg = run_config(f.read())
    parts = RunParts(cfg, None, make_tokenizer(cfg), [], [], [], [])
    jax.devices()  # the client started before the clock
    with Checkpointer(os.path.join(folder, "checkpoints"), max_to_keep=None) as ckpt:
        ckpt.all_steps()
        _release_free_heap()
        with PeakMemory() as peak:
            t = time.perf_counter()
            if mode == "export":
                out = load_hf_model(os.path.join(folder, "export"))
            elif mode == "policy":
                _, out = parts.policy_at(ckpt, 7)
            elif mode == "policy-init":  # RunParts.policy_at as it was
                _, out = nnx.split(parts.create_policy())
                state, _ = ckpt.restore(7, only="params")
                nnx.replace_by_pure_dict(out, _unwrap(state["params"]))
            elif mode in ("resume", "resume-init"):  # the training worker's restore, now and as it was
                model = parts.policy_shapes() if mode == "resume" else parts.create_policy()
                graphdef, params = nnx.split(model)
                out, _ = ckpt.restore(7, learner(cfg, graphdef).init_state(params))
            else:
                state, _ = ckpt.restore(7, only="params" if mode == "params" else None)
                out = state["params"]
            jax.block_until_ready(jax.tree.leaves(out))
            seconds = time.perf_counter() - t
    return {"mode": mode, "seconds": seconds, **peak.result()}


def _child(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.start_policy", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.start_policy {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(workload: str, repeats: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="grpo-bench-start-") as folder:
        built = _child(["--build", workload, "--dir", folder])
        rows = []
        for mode in MODES:
            got = [_child(["--measure", mode, "--dir", folder]) for _ in range(repeats)]
            rows.append(
                {
                    "mode": mode,
                    "seconds": statistics.median(g["seconds"] for g in got),
                    "peak_extra_mib": statistics.median(g["peak_extra_mib"] for g in got),
                }
            )
    return {"workload": workload, "built": built, "rows": rows}


def table(result: dict) -> str:
    b, rows = result["built"], result["rows"]
    base = next(r for r in rows if r["mode"] == "whole")
    lines = [
        f"{result['workload']}: {b['params_m']:.1f} M parameters ({b['params_mib']:.0f} MiB), "
        f"checkpoint with Adam's moments {b['checkpoint_mib']:.0f} MiB (saved in {b['save_s']:.1f} s)",
        f"{'read':<26} {'seconds':>8} {'vs whole':>9} {'peak MiB':>9} {'vs whole':>9}",
    ]
    for r in rows:
        lines.append(
            f"{LABELS[r['mode']]:<26} {r['seconds']:>8.2f} {r['seconds'] / base['seconds']:>8.2f}x "
            f"{r['peak_extra_mib']:>9.0f} {r['peak_extra_mib'] / max(base['peak_extra_mib'], 1e-9):>8.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=WORKLOADS, default="qwen3-vocab")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--build", choices=WORKLOADS, help=argparse.SUPPRESS)
    p.add_argument("--measure", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.build:
        print(json.dumps(build(args.build, args.dir)))
        return 0
    if args.measure:
        print(json.dumps(measure(args.measure, args.dir)))
        return 0
    result = run(args.workload, args.repeats)
    print(table(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
