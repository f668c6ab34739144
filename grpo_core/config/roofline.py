"""Time at real shapes, before the chips exist: a roofline bound on a step's and a run's seconds
from the compiler's figures for a TPU target (grpo_core.rl.aot, per chip and program, loops
counted by grpo_core.rl.hlo_cost) and the chip's published peaks (grpo_core.config.target).

A program takes at least max(FLOPs / peak bf16 FLOP/s, HBM bytes / HBM bandwidth) on each chip:
the programs are SPMD and XLA's figures are one chip's. The sum over a step's programs is a
lower bound on its time, not a forecast: it leaves out kernel launches and per-op latency, the
host (the Python loop, the reward functions, the data), compute and memory traffic that do not
overlap perfectly, and the inter-chip collectives (their bytes are reported, not timed). The
decode loop stops once every row is done; the bound counts its every token step
(`train.sampling.max_new_tokens`), so it is a bound for full-length completions.

JAX-free: the compiler's process makes a step's figures (`step`), and the readiness report,
which knows the run's length (its steps, evaluations and eval rows), adds the run's (`run`).
"""

from __future__ import annotations

import math
from typing import Any

BASIS = (
    "roofline lower bound: max(FLOPs / peak bf16 FLOP/s, HBM bytes / HBM bandwidth) per program and chip, "
    "summed over the programs a step runs; loops counted as they run"
)
IGNORES = (
    "kernel launches and per-op latency",
    "host time: the Python loop, reward functions, data, checkpoints",
    "compute and memory traffic that do not overlap perfectly",
    "inter-chip collectives (collective_bytes, not timed)",
    "compilation",
)
ASSUMES = "every completion runs train.sampling.max_new_tokens tokens (decode stops sooner when every row is done)"
# the programs of one step (the update runs num_iterations x minibatches_per_rollout times)
STEP_PROGRAMS = ("prefill", "decode", "reference", "old_logprobs", "update")


def program_time(p: dict[str, Any], runs: list[int], peaks: dict[str, Any]) -> dict[str, Any]:
    """One call of a compiled program (grpo_core.rl.aot.analyse's figures): FLOPs and bytes with
    its loops counted, its data-bound loops (decode's phases, in program order) run `runs[j]`
    times each, and the roofline's seconds. Loops that do not match `runs` one for one (none is
    expected but decode's) are counted at the dearest's cost, sum(runs) times (once when none)."""
    loops = p.get("iterations") or []
    if len(loops) != len(runs) and loops:
        dearest = {"flops": p["iteration_flops"], "bytes": p["iteration_bytes"]}
        loops, runs = [dict(dearest, collective_bytes=p.get("iteration_collective_bytes") or 0.0)], [sum(runs) or 1]
    elif not loops:
        runs = []
    flops = p["loop_flops"] + sum(n * c["flops"] for c, n in zip(loops, runs))
    nbytes = p["loop_bytes"] + sum(n * c["bytes"] for c, n in zip(loops, runs))
    coll = p.get("collective_bytes", 0.0) + sum(n * c["collective_bytes"] for c, n in zip(loops, runs))
    compute, memory = flops / peaks["bf16_flops_per_s"], nbytes / peaks["hbm_bytes_per_s"]
    return {
        "program": p["program"],
        "iterations": sum(runs),
        "flops": flops,
        "bytes": nbytes,
        "collective_bytes": coll,
        "compute_s": compute,
        "memory_s": memory,
        "s": max(compute, memory),
        "bound": "compute" if compute >= memory else "memory",
    }


def step(
    programs: list[dict[str, Any]],
    peaks: dict[str, Any],
    *,
    runs: tuple[str, ...],
    updates: int,
    rollout_tokens: int,
    decode_runs: list[int],
    weight_bytes: dict[str, int],
) -> dict[str, Any]:
    """A step's bound from its programs' figures (grpo_core.rl.aot.check): `runs` names the step's
    programs (STEP_PROGRAMS the run has), the update called `updates` times; decode's loops run
    `decode_runs[j]` times (sampler.phase_steps); `rollout_tokens` the completions' tokens a step
    (P x G x N). Evaluation's generate is timed per batch (`eval_batch_s`), for `run` to count."""
    calls = {name: updates if name == "update" else 1 for name in runs}
    rows, missing = [], []
    for p in programs:
        if not p.get("compiled") or "loop_flops" not in p:
            missing += [p["program"]] if p["program"] in calls else []
            continue
        row = program_time(p, decode_runs if p["program"].endswith("decode") else [], peaks)
        rows.append(dict(row, calls=calls.get(p["program"], 0), total_s=row["s"] * calls.get(p["program"], 0)))
    timed = {r["program"]: r for r in rows}
    missing += [name for name in calls if name not in timed and name not in missing]
    split = {
        "rollout": sum(timed[k]["total_s"] for k in ("prefill", "decode") if k in timed),
        **{k: timed[k]["total_s"] for k in ("reference", "old_logprobs", "update") if k in timed},
    }
    step_s = None if missing else sum(split.values())
    rollout_s = split["rollout"] if {"prefill", "decode"} <= timed.keys() else None
    ev = [timed.get(k) for k in ("eval_prefill", "eval_decode")]
    return {
        "basis": BASIS,
        "peaks": peaks,
        "step_s": step_s,
        "split_s": split,
        "updates_per_step": updates,
        "rollout_tokens": rollout_tokens,
        "rollout_tokens_per_s": rollout_tokens / rollout_s if rollout_s else None,
        "decode_runs": decode_runs,
        "assumes": ASSUMES,
        "flops_per_step": sum(r["flops"] * r["calls"] for r in rows),
        "collective_bytes_per_step": sum(r["collective_bytes"] * r["calls"] for r in rows),
        "eval_batch_s": None if None in ev else sum(r["s"] for r in ev),
        "weight_bytes": weight_bytes,
        "programs": rows,
        "missing": missing,
        "ignores": list(IGNORES),
    }


SPLIT_IGNORES = (
    "the weights' copy from the learner's chips to the rollout's after each update (weight_bytes, not timed)",
    "a side's waits when the two sides' times vary from step to step (the bound takes each side's as fixed)",
)


def split_step(
    colocated: dict[str, Any],
    learner: dict[str, Any],
    rollout: dict[str, Any],
    *,
    max_staleness: int,
    learner_chips: int,
    rollout_chips: int,
    weight_bytes: int,
) -> dict[str, Any]:
    """A step on a split of the chips (train.rollout.layout=split), from each side's own bound
    (`step`'s, its programs compiled for its chips): synchronous (k = 0) each side waits for the
    other, so the step is their sum; asynchronous (k >= 1) they overlap, so the step is the slower
    side's. `colocated`: the synchronous step on every chip (the same programs on all of them)."""
    side = {"learner": learner["step_s"], "rollout": rollout["step_s"]}
    known = None not in side.values()
    slower = max(side, key=lambda k: side[k]) if known else None
    sync_s = sum(side.values()) if known else None
    async_s = max(side.values()) if known else None
    colo = colocated.get("step_s")
    return {
        "basis": "each side's roofline bound on its own chips; synchronous: their sum, asynchronous: the slower",
        "learner_chips": learner_chips,
        "rollout_chips": rollout_chips,
        "max_staleness": max_staleness,
        "learner_s": side["learner"],
        "rollout_s": side["rollout"],
        "learner_split_s": learner["split_s"],
        "rollout_split_s": rollout["split_s"],
        "slower_side": slower,
        "sync_step_s": sync_s,
        "async_step_s": async_s,
        "step_s": async_s if max_staleness > 0 else sync_s,  # what this config's step is bound by
        "colocated_step_s": colo,
        "async_vs_colocated": colo / async_s if known and colo and async_s else None,
        "weight_bytes": weight_bytes,
        "missing": learner["missing"] + rollout["missing"],
        "ignores": list(SPLIT_IGNORES),
        "programs": {"learner": learner["programs"], "rollout": rollout["programs"]},
    }


def run(
    est: dict[str, Any],
    *,
    num_steps: int | None,
    evaluations: int,
    eval_rows: int | None,
    batch_size: int,
    num_samples: int,
    new_tokens: int,
) -> dict[str, Any]:
    """The run's bound: `num_steps` steps of `est` (step's) and `evaluations` evaluations of
    `eval_rows` rows (None: not known here, the data not read), eval.batch_size and
    eval.num_samples as the config says."""
    out = dict(est, num_steps=num_steps, evaluations=evaluations)
    if eval_rows is None:
        out["eval"] = {"s": None, "unknown": "the eval rows are not counted here (the data was not read)"}
    else:
        out["eval"] = _evaluation(est, eval_rows, batch_size, num_samples, new_tokens)
    train_s = None if num_steps is None or est["step_s"] is None else est["step_s"] * num_steps
    eval_s = out["eval"]["s"]
    out["train_s"] = train_s
    out["run_s"] = None if train_s is None else train_s + evaluations * (eval_s or 0.0)
    out["run_includes_eval"] = eval_s is not None
    if num_steps is None:
        out["unknown"] = "train.num_steps is auto and the data was not read"
    return out


def rollout_advice(est: dict[str, Any], *, rollout_mesh_set: bool, devices: int) -> str | None:
    """What to try when decode gathers weights at every token step: a rollout on the learner's
    mesh reads weights split over its chips (fsdp, tensor), so each token step collects them
    again (compiled for v5e:2x2 at the GSM8K recipe's shapes with Qwen2.5-0.5B: 0.30 GB of
    collectives and 3.8 GB of HBM traffic a token step on each chip, against 1.7 GB with the
    rollout's own copy of the weights on every chip, train.mesh.rollout: {data: -1, fsdp: 1}, for
    1.33 GiB more a chip; the step's bound 3.98 s against 2.66 s). None when the rollout has a
    layout of its own or decode gathers next to nothing."""
    decode = next((r for r in est.get("programs", []) if r["program"] == "decode"), None)
    if rollout_mesh_set or devices < 2 or decode is None or not decode["iterations"]:
        return None
    per_step = decode["collective_bytes"] / decode["iterations"]
    if per_step <= 0.01 * decode["bytes"] / decode["iterations"]:
        return None
    return (
        f"decode collects the learner's split weights at each token step ({per_step / 1e9:.3g} GB of collectives "
        'a token step on each chip, not timed above); --set \'train.mesh.rollout={"data": -1, "fsdp": 1}\' gives '
        f"the rollout a copy of the weights on each of the {devices} chips, beside the learner's: check again with it "
        "to see whether it fits and what the bound becomes"
    )


def _evaluation(est: dict[str, Any], rows: int, batch_size: int, num_samples: int, new_tokens: int) -> dict[str, Any]:
    """One evaluation (grpo_core.stages.worker.evaluate_steps): a greedy pass over the eval rows and,
    with eval.num_samples > 1, a sampled pass, each in batches of eval.batch_size prompts. The
    check compiles one pass's program (the sampled one; the greedy with one sample) at
    eval.batch_size prompts; a pass it did not compile, or a single batch of fewer rows, is bound
    by its weights: each token step reads them all."""
    batches = math.ceil(rows / batch_size)
    floor = new_tokens * est["weight_bytes"]["eval"] / est["peaks"]["hbm_bytes_per_s"]
    compiled = est["eval_batch_s"] if rows >= batch_size else None
    main = "sampled" if num_samples > 1 else "greedy"
    passes = {main: {"batches": batches, "batch_s": compiled or floor, "basis": "compiled" if compiled else "weights"}}
    if num_samples > 1:
        passes["greedy"] = {"batches": batches, "batch_s": floor, "basis": "weights"}
    return {
        "rows": rows,
        "batch_size": batch_size,
        "passes": passes,
        "weights_basis": "max_new_tokens x the weights' bytes per chip / HBM bandwidth a batch",
        "s": sum(p["batches"] * p["batch_s"] for p in passes.values()),
    }
