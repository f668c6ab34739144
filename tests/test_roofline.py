"""The roofline bound (grpo_core.config.roofline): a program's seconds from its FLOPs and bytes
against a chip's peaks, a step's from its programs, a run's from its steps and evaluations.
Pinned numbers on made-up figures; the figures XLA gives real programs are tests/test_aot.py's."""

import pytest

from grpo_core.config import roofline
from grpo_core.config.target import Target

PEAKS = {"generation": "x", "bf16_flops_per_s": 100.0, "hbm_bytes_per_s": 10.0, "source": "-"}


def _fig(name, flops, nbytes, it_flops=None, it_bytes=None):
    loops = [] if it_flops is None else [{"flops": it_flops, "bytes": it_bytes, "collective_bytes": 0.5}]
    return {
        "program": name,
        "compiled": True,
        "loop_flops": flops,
        "loop_bytes": nbytes,
        "collective_bytes": 1.0,
        "iteration_flops": it_flops,
        "iteration_bytes": it_bytes,
        "iteration_collective_bytes": None if it_flops is None else 0.5,
        "iterations": loops,
    }


PROGRAMS = [
    _fig("update", 400.0, 10.0),  # 4 s of compute, 1 s of memory: compute-bound
    _fig("prefill", 100.0, 20.0),  # 1 s, 2 s: memory-bound
    _fig("decode", 0.0, 5.0, it_flops=10.0, it_bytes=5.0),  # 0.5 + 9 x 0.5 s: memory-bound
    _fig("eval_prefill", 100.0, 10.0),
    _fig("eval_decode", 0.0, 10.0, it_flops=10.0, it_bytes=10.0),
]


def _step(programs=PROGRAMS, **kw):
    args = dict(
        runs=("prefill", "decode", "update"),
        updates=2,
        rollout_tokens=100,
        decode_runs=[9],
        weight_bytes={"rollout": 2, "eval": 3},
    )
    return roofline.step(programs, PEAKS, **(args | kw))


def test_a_program_is_bound_by_the_slower_of_its_flops_and_its_bytes():
    decode = roofline.program_time(PROGRAMS[2], [9], PEAKS)
    assert (decode["flops"], decode["bytes"], decode["collective_bytes"]) == (90.0, 50.0, 5.5)
    assert (decode["iterations"], decode["s"], decode["bound"]) == (9, 5.0, "memory")
    update = roofline.program_time(PROGRAMS[0], [9], PEAKS)  # no data-bound loop: the runs do not apply
    assert (update["iterations"], update["s"], update["bound"]) == (0, 4.0, "compute")


def test_decode_phases_each_run_their_own_token_steps():
    """The sampler's decode loop in phases (sampler.phase_steps), each reading the cache it can have
    filled: phase j's iteration cost times its steps; loops that do not match the steps one for
    one counted at the dearest's cost."""
    phased = dict(PROGRAMS[2], iterations=[
        {"flops": 10.0, "bytes": 2.0, "collective_bytes": 0.0},
        {"flops": 10.0, "bytes": 8.0, "collective_bytes": 0.0},
    ], iteration_bytes=8.0)  # fmt: skip
    assert roofline.program_time(phased, [4, 5], PEAKS)["bytes"] == 5.0 + 4 * 2.0 + 5 * 8.0
    assert roofline.program_time(phased, [9], PEAKS)["bytes"] == 5.0 + 9 * 8.0


def test_a_step_sums_its_programs_the_update_once_per_update():
    est = _step()
    assert est["split_s"] == {"rollout": 2.0 + 5.0, "update": 2 * 4.0}
    assert est["step_s"] == 15.0 and est["rollout_tokens_per_s"] == 100 / 7.0
    assert est["flops_per_step"] == 2 * 400 + 100 + 90  # evaluation's programs are not the step's
    assert est["eval_batch_s"] == 1.0 + 10.0 and est["missing"] == []
    assert "lower bound" in est["basis"] and est["peaks"] is PEAKS
    # a program the step runs that did not compile (or was not asked for): no step bound
    assert _step(runs=("prefill", "decode", "reference", "update"))["step_s"] is None
    refused = _step([{"program": "update", "compiled": False}, *PROGRAMS[1:]])
    assert refused["step_s"] is None and refused["missing"] == ["update"]


def test_a_rollout_that_gathers_weights_each_token_step_is_told_what_to_try():
    """Decode on the learner's mesh collects its split weights at every token step: the estimate
    names train.mesh.rollout with the target's chips; not when the rollout has its own layout, on
    one chip, or when decode's collectives are a trifle of its traffic."""
    est = _step()  # decode: 0.5 of collectives against 5.0 bytes a token step, 5.5 over 9 steps
    [advice] = [roofline.rollout_advice(est, rollout_mesh_set=False, devices=4)]
    assert 'train.mesh.rollout={"data": -1, "fsdp": 1}' in advice, advice
    assert f"{5.5 / 9 / 1e9:.3g} GB of collectives a token step" in advice
    assert roofline.rollout_advice(est, rollout_mesh_set=True, devices=4) is None
    assert roofline.rollout_advice(est, rollout_mesh_set=False, devices=1) is None
    quiet = dict(PROGRAMS[2], collective_bytes=0.0, iterations=[{"flops": 10.0, "bytes": 5.0, "collective_bytes": 0.0}])
    assert roofline.rollout_advice(_step([*PROGRAMS[:2], quiet]), rollout_mesh_set=False, devices=4) is None


def test_a_run_counts_its_steps_and_both_evaluation_passes():
    kw = dict(num_steps=10, evaluations=3, batch_size=4, num_samples=4, new_tokens=10)
    out = roofline.run(_step(), eval_rows=8, **kw)
    ev = out["eval"]
    # 2 batches of 4 prompts: the sampled pass as compiled (11 s a batch); the greedy pass, not
    # compiled, bound by reading the weights at each of its 10 token steps (10 x 3 / 10 = 3 s)
    assert ev["passes"] == {
        "sampled": {"batches": 2, "batch_s": 11.0, "basis": "compiled"},
        "greedy": {"batches": 2, "batch_s": 3.0, "basis": "weights"},
    }
    assert ev["s"] == 28.0 and out["train_s"] == 150.0 and out["run_s"] == 150.0 + 3 * 28.0
    # fewer rows than a batch: one smaller batch than the compiled program, bound by its weights
    one = roofline.run(_step(), eval_rows=3, **kw)["eval"]["passes"]["sampled"]
    assert one == {"batches": 1, "batch_s": 3.0, "basis": "weights"}
    greedy_only = roofline.run(_step(), eval_rows=8, **(kw | {"num_samples": 1}))["eval"]
    assert list(greedy_only["passes"]) == ["greedy"] and greedy_only["passes"]["greedy"]["basis"] == "compiled"
    # what is not known here is said, not guessed
    unread = roofline.run(_step(), eval_rows=None, **kw)
    assert unread["run_s"] == 150.0 and not unread["run_includes_eval"] and "not counted" in unread["eval"]["unknown"]
    auto = roofline.run(_step(), eval_rows=None, **(kw | {"num_steps": None}))
    assert auto["run_s"] is None and "auto" in auto["unknown"]


@pytest.mark.parametrize(
    ("name", "flops", "hbm"), [("v4:2x2x1", 275e12, 1200e9), ("v5e:2x2", 197e12, 819e9), ("v6e:2x2", 918e12, 1638e9)]
)
def test_each_generation_has_its_published_peaks(name, flops, hbm):
    peaks = Target.parse(name).peaks()
    assert (peaks["bf16_flops_per_s"], peaks["hbm_bytes_per_s"]) == (flops, hbm)
    assert peaks["source"] == f"https://cloud.google.com/tpu/docs/{name.split(':')[0]}"
