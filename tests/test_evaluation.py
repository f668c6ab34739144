import copy

import numpy as np
import pytest
from flax import nnx

from grpo_core.rewards.functions import Reward
from grpo_core.rl.evaluation import evaluate, pass_at_k
from grpo_core.testing import SYNTHETIC_DEFAULT, build_synthetic


@pytest.mark.parametrize(
    "n, c, k, want",
    [
        (4, 0, 1, 0.0),
        (4, 4, 2, 1.0),
        (4, 1, 1, 0.25),  # 1 - 3/4
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    ],
)
def test_pass_at_k(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want)


def test_evaluate_greedy_and_sampled():
    cfg = copy.deepcopy(SYNTHETIC_DEFAULT)
    run = build_synthetic(cfg)
    graphdef, params = nnx.split(run.model)

    def always_one(prompts, completions, **_):
        return [1.0] * len(completions)

    rows = run.eval_rows[:10]
    greedy = evaluate(graphdef, params, run.tokenizer, rows, [Reward(always_one)], run.train.sampling, batch_size=4)
    assert greedy["num_rows"] == 10 and greedy["always_one"] == 1.0 and "pass@1" not in greedy
    sampled = evaluate(
        graphdef,
        params,
        run.tokenizer,
        rows,
        run.eval_rewards + [Reward(always_one, 0.0)],
        run.train.sampling,
        batch_size=4,
        num_samples=4,
    )
    assert sampled["pass@1"] <= sampled["pass@4"] <= 1.0
    assert 0.0 <= sampled["exact_match"] <= 1.0


def eval_child(out: str) -> None:
    """In a process with 4 CPU devices: evaluation's completions on one device and over the
    rollout's mesh (the evaluation worker's layout), and how many devices each generate used."""
    import json

    import jax

    from grpo_core.config.train import MeshConfig
    from grpo_core.rl import evaluation
    from grpo_core.runtime.mesh import Placement

    run = build_synthetic(copy.deepcopy(SYNTHETIC_DEFAULT))
    graphdef, params = nnx.split(run.model)
    used = []
    real_generate = evaluation.generate

    def counting(*args, **kw):
        c = real_generate(*args, **kw)
        used.append(len(c.tokens.sharding.device_set))
        return c

    evaluation.generate = counting
    rows = run.eval_rows[:10]
    sampling = run.train.sampling.replace(temperature=1.0)
    result = {}
    for name, placement in (("one", None), ("mesh", Placement.from_config(MeshConfig(), jax.devices()))):
        texts = {}
        for samples in (1, 4):
            batches = evaluation.complete(
                graphdef, params, run.tokenizer, rows, sampling, batch_size=4, num_samples=samples, placement=placement
            )
            texts[samples] = [t for _, ts, _, _ in batches for t in ts]  # (rows, texts, arrays, episodes)
        result[name] = {"texts": texts, "devices": used[:]}
        used.clear()
    with open(out, "w") as f:
        json.dump(result, f)


def test_evaluation_generates_over_the_rollout_mesh_as_on_one_device(tmp_path):
    """The evaluation worker lays weights and prompts over the rollout's mesh: the same greedy
    and sampled completions as on one device, each batch generated on all 4 devices."""
    import json

    from tests.cpu_devices import run_with_devices

    out = str(tmp_path / "eval.json")
    run_with_devices(4, f"import tests.test_evaluation as t; t.eval_child({out!r})")
    with open(out) as f:
        res = json.load(f)
    assert res["one"]["devices"] == [1] * 6 and res["mesh"]["devices"] == [4] * 6  # 3 batches, greedy and sampled
    assert len(res["mesh"]["texts"]["1"]) == 10 and len(res["mesh"]["texts"]["4"]) == 40
    assert res["mesh"]["texts"] == res["one"]["texts"]


@pytest.mark.slow
def test_two_processes_evaluate_together_as_one_does(tmp_path):
    """Multi-host evaluation: the worker's generate spans both processes' devices (the rollout's
    mesh) and each gets the completions whole; the figures and examples equal one process's."""
    from tests.test_multihost import TWO
    from tests.test_worker import make_run

    results = {}
    for name, launcher in (("one", None), ("two", TWO)):
        results[name] = _evaluate_step_0(make_run(str(tmp_path), name), launcher)
    one, two = results["one"], results["two"]
    assert (one["devices"], two["devices"]) == (1, 2)  # one CPU device a process: the mesh spans both
    assert two["greedy"]["num_rows"] == 8 and "pass@2" in two
    for key in ("accuracy", "greedy", "sampled", "examples"):
        assert two[key] == one[key], key


def test_the_starting_policy_reaches_the_sampler_as_a_restored_checkpoint_does(tmp_path):
    """Step 0 (the model as built) and a trained step (restored by Orbax) come out of policy_at
    alike, committed to the same device: uncommitted, step 0 lowered to programs of its own, and a
    worker evaluating steps 0 and N compiled every sampler program twice (18 CPU-s instead of 29
    for the tiny run's eval of 0 and 6 on an empty compilation cache)."""
    import jax

    from grpo_core.config.run import RunConfig
    from grpo_core.rl.checkpoint import Checkpointer
    from grpo_core.stages.parts import open_run
    from grpo_core.store.root import RunRoot
    from tests.test_worker import make_run

    root = RunRoot(make_run(str(tmp_path), "placed"))
    parts = open_run(RunConfig.from_dict(root.read_json("config.json")), root)
    with Checkpointer(root.uri("checkpoints")) as ckpt:
        _, start = parts.policy_at(ckpt, 0)
        ckpt.save(1, {"params": nnx.to_pure_dict(start)}, {"config_hash": parts.cfg.train_hash})
        ckpt.wait()
        _, restored = parts.policy_at(ckpt, 1)
        _, on_host = parts.policy_at(ckpt, 1, on_host=True)  # an export's: never whole on a device
    placed = lambda params: {(a.sharding, a.committed) for a in jax.tree.leaves(params)}  # noqa: E731
    assert placed(start) == placed(restored) == {(jax.sharding.SingleDeviceSharding(jax.local_devices()[0]), True)}
    assert {type(a) for a in jax.tree.leaves(on_host)} == {np.ndarray}
    for other in (restored, on_host):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), start, other)


def test_on_a_mesh_the_policy_is_read_straight_into_its_shards(tmp_path):
    """With a rollout mesh of several devices, policy_at lays the starting policy and a restored
    checkpoint out over it as the sampler takes them: a checkpoint is read into its shards, never
    whole onto one device first (the 7B recipe's 30 GB of f32 parameters against a 16 GB chip)."""
    from tests.cpu_devices import run_with_devices
    from tests.test_worker import make_run

    root = make_run(str(tmp_path), "sharded")
    run_with_devices(2, f"import tests.test_evaluation as t; t.placed_child({root!r})")


def placed_child(url: str) -> None:
    import jax

    from grpo_core.config.run import RunConfig
    from grpo_core.rl.checkpoint import Checkpointer
    from grpo_core.runtime.mesh import Placement
    from grpo_core.stages.parts import open_run
    from grpo_core.store.root import RunRoot

    root = RunRoot(url)
    parts = open_run(RunConfig.from_dict(root.read_json("config.json")), root)
    placement = Placement.from_config(parts.cfg.train.mesh)
    mesh = placement.rollout
    assert mesh.size == 2
    with Checkpointer(root.uri("checkpoints")) as ckpt:
        _, start = parts.policy_at(ckpt, 0, placement)
        _, here = parts.policy_at(ckpt, 0)  # on this process's first device, as before
        ckpt.save(1, {"params": nnx.to_pure_dict(here)}, {"config_hash": parts.cfg.train_hash})
        ckpt.wait()
        _, restored = parts.policy_at(ckpt, 1, placement)
    for params in (start, restored):
        laid = jax.tree.map(lambda a, s: a.sharding == s, params, placement.param_shardings(params, mesh))
        assert all(jax.tree.leaves(laid)), laid
        assert any(not a.sharding.is_fully_replicated for a in jax.tree.leaves(params))  # split, not copied
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, here)


def test_a_run_trained_on_a_larger_mesh_evaluates_on_this_hosts_devices(tmp_path):
    """train.mesh names 4-way fsdp; this host has one device: evaluation says so and runs over
    the default mesh of what is here (a nightly evaluation on another machine than training's)."""
    from tests.test_worker import make_run

    train = {"num_steps": 6, "grpo": {"prompts_per_step": 4}, "mesh": {"data": 1, "fsdp": 4, "tensor": 1}}
    result = _evaluate_step_0(make_run(str(tmp_path), "wide", train=train))
    assert result["devices"] == 1 and result["greedy"]["num_rows"] == 8


def _evaluate_step_0(root: str, launcher=None) -> dict:
    """`worker eval --steps 0` (the starting policy) through `launcher`; its eval/0.json."""
    from grpo_core.store.root import RunRoot
    from tasks.process import run_worker

    events = []
    args = ["grpo_core.stages.worker", "eval", "--root", root, "--steps", "0"]
    run_worker(args, timeout_s=240, on_event=events.append, what="evaluation", launcher=launcher)
    assert [e["event"] for e in events if e["event"] == "eval"] == ["eval"]
    return RunRoot(root).read_json("eval/0.json")
