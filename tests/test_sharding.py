"""Sharded training: the mesh config, the layout rules, and a GRPO run on a data=2 x fsdp=2 x
tensor=2 mesh of 8 CPU devices that agrees with the same run on one device.

XLA_FLAGS must be set before JAX starts, so the runs happen in child processes
(`python -c "...child(...)"`), each writing its losses, final parameters and the layouts it saw.
"""

import json

import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from grpo_core.config.train import MeshConfig, TrainConfig
from grpo_core.errors import ConfigError
from grpo_core.runtime.mesh import KV_CACHE_AXES, fit, partition_axes
from tests.cpu_devices import run_with_devices

STEPS = 3


def test_mesh_config_validates_and_resolves():
    assert MeshConfig().sizes(1) == (1, 1, 1) and MeshConfig().sizes(8) == (1, 8, 1)
    assert MeshConfig(data=2, fsdp=2, tensor=2).sizes(8) == (2, 2, 2)
    assert MeshConfig(data=-1, tensor=2, fsdp=1).sizes(8) == (4, 1, 2)
    with pytest.raises(
        ConfigError, match=r"train.mesh \{data: 2, fsdp: 2, tensor: 2\} needs 8 devices, but this run has 4"
    ):
        MeshConfig(data=2, fsdp=2, tensor=2).sizes(4)
    with pytest.raises(ConfigError, match="6 devices do not divide"):
        MeshConfig(data=4).sizes(6)
    with pytest.raises(ConfigError, match="at most one mesh axis may be -1, got train.mesh.data and train.mesh.fsdp"):
        MeshConfig(data=-1)
    with pytest.raises(
        ConfigError, match=r"train.mesh.rollout.tensor must be a positive integer or -1 \(the rest\), got 0"
    ):
        TrainConfig.from_dict({"mesh": {"rollout": {"tensor": 0}}})
    with pytest.raises(ConfigError, match=r"train.mesh.reference: unknown field\(s\) \['pipeline'\]"):
        TrainConfig.from_dict({"mesh": {"reference": {"pipeline": 2}}})
    t = TrainConfig.from_dict({"mesh": {"data": 2, "rollout": {"data": -1, "fsdp": 1}}})
    assert TrainConfig.from_dict(t.to_dict()) == t
    assert "mesh" not in t.hash_fields()  # a run resumes on another mesh


def test_layout_rules():
    mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
    rule = lambda *path, shape: fit(partition_axes(path, len(shape)), shape, mesh)
    assert rule("model", "embed_tokens", "embedding", "value", shape=(50, 128)) == P("tensor", "fsdp")
    assert rule("model", "layers", "self_attn", "q_proj", "kernel", shape=(2, 128, 128)) == P(None, "fsdp", "tensor")
    assert rule("model", "layers", "mlp", "down_proj", "kernel", shape=(2, 256, 128)) == P(None, "tensor", "fsdp")
    assert rule("model", "layers", "self_attn", "q_proj", "bias", shape=(2, 128)) == P(None, "tensor")
    assert rule("model", "layers", "mlp", "up_proj", "lora_a", shape=(2, 128, 8)) == P(None, "fsdp")
    assert rule("model", "layers", "mlp", "up_proj", "lora_b", shape=(2, 8, 256)) == P(None, None, "tensor")
    assert rule("model", "layers", "input_layernorm", "weight", shape=(2, 128)) == P()
    # An AdamW moment's path ends with its parameter's: it is split the same way.
    assert rule("1", "0", "mu", "model", "layers", "mlp", "up_proj", "kernel", shape=(2, 128, 256)) == P(
        None, "fsdp", "tensor"
    )
    assert rule("0", "count", shape=()) == P()
    assert rule("model", "embed_tokens", "embedding", shape=(51, 128)) == P(None, "fsdp")  # 51 rows stay whole
    assert fit(KV_CACHE_AXES, (2, 8, 2, 10, 32), mesh) == P(None, ("data", "fsdp"), "tensor")
    assert fit(KV_CACHE_AXES, (2, 6, 3, 10, 32), mesh) == P(None, "data")  # 6 rows: data only; 3 heads whole
    assert fit(KV_CACHE_AXES, (2, 8, 2, 10, 32), AbstractMesh((1, 8, 1), ("data", "fsdp", "tensor"))) == P(None, "fsdp")


def test_readiness_counts_memory_per_device_and_checks_the_mesh():
    from grpo_core.config import memory
    from grpo_core.config.presets import get_preset
    from grpo_core.stages.readiness import _mesh_check

    m, train = get_preset("qwen3-0.6b"), TrainConfig.from_dict({"mesh": {"data": 2, "fsdp": -1, "tensor": 2}})
    facts = {"backend": "tpu", "available": None, "runtime": 0}
    one = memory.plan_on(m, train, 64, dict(facts, devices=1)).estimate  # the mesh does not divide 1: all on one
    eight = memory.plan_on(m, train, 64, dict(facts, devices=8)).estimate
    assert eight.terms["params"] == -(-one.terms["params"] // 4)  # fsdp=2 x tensor=2
    assert eight.terms["kv_cache"] == -(-one.terms["kv_cache"] // 8)  # every axis splits a batch
    ok = _mesh_check(train, 8)
    assert ok["ok"] and ok["detail"] == "train data=2 x fsdp=2 x tensor=2 over 8 devices"
    bad = _mesh_check(TrainConfig.from_dict({"mesh": {"rollout": {"data": 3, "fsdp": 1}}}), 8)
    assert not bad["ok"] and bad["detail"].startswith(
        "train.mesh.rollout {data: 3, fsdp: 1, tensor: 1} needs 3 devices"
    )


def child(mesh: dict | None, out: str, lora: bool = False) -> None:
    """One GRPO run of STEPS steps on the synthetic task (beta > 0: the reference is scored too;
    `lora`: adapters on every linear); writes losses, final parameters and the layouts of a few
    arrays to `out` (.npz + .json)."""
    import copy

    import jax
    from flax import nnx

    from grpo_core.rl.sampler import prefill, step_key
    from grpo_core.rl.trainer import GRPOTrainer
    from grpo_core.testing import SYNTHETIC_DEFAULT, build_synthetic

    cfg = copy.deepcopy(SYNTHETIC_DEFAULT)
    cfg["train"].update(num_steps=STEPS, mesh=mesh or {})
    cfg["train"]["grpo"].update(prompts_per_step=4, num_generations=4, beta=0.05)
    if lora:
        cfg["model"]["lora"] = {"rank": 4}
        cfg["train"]["optimizer"]["warmup_steps"] = 0  # adapters start at B = 0: move them from step 0
    run = build_synthetic(cfg)
    tr = GRPOTrainer(run.model, run.train, run.tokenizer, run.rewards, run.task)
    metrics = [tr.train_step() for _ in range(STEPS)]
    pl = tr.placement
    flat = {".".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(tr.params)}
    np.savez(out + ".npz", **flat)
    spec = lambda x: [list(a) if isinstance(a, tuple) else a for a in x.sharding.spec]  # JSON-able
    mu = tr.state["opt_state"][1][0].mu["model"]["layers"]["mlp"]  # clip_by_global_norm, then adamw's ScaleByAdamState
    up = tr.params["model"]["layers"]["mlp"]["up_proj"]
    ptok = np.full((4, 8), 3, np.int32)
    cache, *_ = prefill(
        tr.graphdef,
        pl.rollout_params(tr.params),
        *pl.put_batch((ptok, ptok > 0), pl.rollout),
        step_key(0, 0),
        opts=tr.opts,
        num_samples=4,
        mesh=pl.rollout,
    )
    layout = {
        "devices": jax.device_count(),
        "mesh": dict(pl.train.shape),
        "rollout_mesh": dict(pl.rollout.shape),
        "q_proj": spec(tr.params["model"]["layers"]["self_attn"]["q_proj"]["kernel"][...]),
        "embedding": spec(tr.params["model"]["embed_tokens"]["embedding"][...]),
        "norm": spec(tr.params["model"]["norm"]["weight"][...]),
        "mu_down_proj": spec(mu["down_proj"]["lora_b" if lora else "kernel"][...]),
        **({"lora_a_up": spec(up["lora_a"][...]), "lora_b_up": spec(up["lora_b"][...])} if lora else {}),
        "ref_q_proj": spec(tr.ref_params["model"]["layers"]["self_attn"]["q_proj"]["kernel"][...]),
        # decode's straight-code layers (CPU's default) take a (B, K, S, D) buffer per layer
        "kv_cache_layers": len(cache[0]) if isinstance(cache[0], tuple) else 0,
        "kv_cache": spec(cache[0][0] if isinstance(cache[0], tuple) else cache[0]),
        "kv_cache_rows": int(cache[0][0].shape[0] if isinstance(cache[0], tuple) else cache[0].shape[1]),
        "q_proj_shard": list(
            tr.params["model"]["layers"]["self_attn"]["q_proj"]["kernel"][...].addressable_shards[0].data.shape
        ),
    }
    if mesh and not lora:  # resume on another layout of the same devices: Orbax reads onto the new shardings
        from grpo_core.rl.checkpoint import Checkpointer

        cfg["train"]["mesh"] = {"data": 1, "fsdp": 8, "tensor": 1}
        fresh = build_synthetic(cfg)  # a new model: a trainer consumes (donates) the arrays of the one it is given
        again = GRPOTrainer(fresh.model, fresh.train, fresh.tokenizer, fresh.rewards, fresh.task)
        with Checkpointer(out + "-ckpt") as ckpt:
            tr.save(ckpt)
            ckpt.wait()
            assert again.restore(ckpt) and again.step == STEPS
        moved = again.params["model"]["layers"]["self_attn"]["q_proj"]["kernel"][...]
        layout["resumed_q_proj"] = spec(moved)
        layout["resumed_equal"] = bool(np.array_equal(np.asarray(moved), flat["model.layers.self_attn.q_proj.kernel"]))
    keys = ("loss", "reward", "kl", "grad_norm", "entropy")
    with open(out + ".json", "w") as f:
        json.dump({"metrics": [{k: m[k] for k in keys} for m in metrics], "layout": layout}, f)


def _run_child(tmp_path, name: str, devices: int, mesh: dict | None, lora: bool = False):
    out = str(tmp_path / name)
    run_with_devices(devices, f"import tests.test_sharding as t; t.child({mesh!r}, {out!r}, {lora!r})")
    with open(out + ".json") as f:
        res = json.load(f)
    return res, dict(np.load(out + ".npz"))


@pytest.mark.slow
def test_sharded_run_matches_one_device(tmp_path):
    one, p1 = _run_child(tmp_path, "one", 1, None)
    mesh = {"data": 2, "fsdp": 2, "tensor": 2, "rollout": {"data": 4, "fsdp": 1, "tensor": 2}}
    eight, p8 = _run_child(tmp_path, "eight", 8, mesh)

    lay = eight["layout"]
    assert lay["devices"] == 8 and lay["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert lay["rollout_mesh"] == {"data": 4, "fsdp": 1, "tensor": 2}
    assert lay["q_proj"] == [None, "fsdp", "tensor"]  # (L, E, H*D)
    assert lay["q_proj_shard"] == [2, 64, 64]  # each device holds a quarter of it
    assert lay["embedding"] == ["tensor", "fsdp"]
    assert lay["norm"] == []
    assert lay["mu_down_proj"] == [None, "tensor", "fsdp"]  # AdamW moments like their params
    assert lay["ref_q_proj"] == lay["q_proj"]
    # KV cache of 4 prompts x 4 samples on the rollout mesh: rows over data, kv heads over tensor.
    assert lay["kv_cache_layers"] == 2 and lay["kv_cache"] == ["data", "tensor"] and lay["kv_cache_rows"] == 16
    assert one["layout"]["q_proj"] == []
    assert lay["resumed_q_proj"] == [None, "fsdp"] and lay["resumed_equal"]  # restored onto fsdp=8 (64 heads-dims / 8)

    # Same seed, same steps: the same sampled tokens, so the same rewards; losses and parameters
    # agree to float32 reduction-order noise (sums split across devices add in another order).
    for a, b in zip(one["metrics"], eight["metrics"]):
        assert b["reward"] == a["reward"]
        for k in ("loss", "kl", "grad_norm", "entropy"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    assert one["metrics"][-1]["kl"] > 0  # the policy moved, and the reference was scored
    assert p1.keys() == p8.keys()
    for k in p1:
        np.testing.assert_allclose(p8[k], p1[k], rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.slow
def test_sharded_lora_run_matches_one_device(tmp_path):
    """LoRA on the mesh: the frozen base and the adapters laid out like the kernels they adapt."""
    one, p1 = _run_child(tmp_path, "one", 1, None, lora=True)
    eight, p8 = _run_child(tmp_path, "eight", 8, {"data": 2, "fsdp": 2, "tensor": 2}, lora=True)
    assert eight["layout"]["q_proj"] == [None, "fsdp", "tensor"]  # the frozen base
    assert eight["layout"]["mu_down_proj"] == [None, None, "fsdp"]  # moments of the adapters only, laid out like them
    assert eight["layout"]["lora_a_up"] == [None, "fsdp"] and eight["layout"]["lora_b_up"] == [None, None, "tensor"]
    for a, b in zip(one["metrics"], eight["metrics"]):
        assert b["reward"] == a["reward"]
        for k in ("loss", "kl", "grad_norm", "entropy"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    assert one["metrics"][-1]["kl"] > 0
    for k in p1:
        np.testing.assert_allclose(p8[k], p1[k], rtol=1e-4, atol=1e-5, err_msg=k)


def load_child(folder: str, out: str) -> None:
    """Load a Hugging Face folder onto a data=2 x fsdp=2 x tensor=2 mesh and without one; write
    how each parameter came out."""
    import jax
    from flax import nnx

    from grpo_core.nn.hf import load_hf_model
    from grpo_core.runtime.mesh import Placement

    pl = Placement.from_config(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = dict(nnx.to_flat_state(nnx.state(load_hf_model(folder, placement=pl))))
    plain = dict(nnx.to_flat_state(nnx.state(load_hf_model(folder))))
    rows = {}
    for path, v in sharded.items():
        a = v[...]
        rows[".".join(map(str, path))] = {
            "as_placed": a.sharding == pl.param_sharding(path, a.shape),
            "equal": bool(np.array_equal(np.asarray(a), np.asarray(plain[path][...]))),
            "spec": [list(x) if isinstance(x, tuple) else x for x in a.sharding.spec],
            "shape": list(a.shape),
            "shard": list(a.addressable_shards[0].data.shape),
            "devices": len(a.sharding.device_set),
        }
    with open(out, "w") as f:
        json.dump({"devices": jax.device_count(), "params": rows}, f)


def test_checkpoint_loads_straight_onto_the_mesh(tmp_path):
    """model.path weights go to their shards as they are read (no whole copy on one device),
    and equal what an unsharded load gives."""
    from grpo_core.config.presets import get_preset
    from grpo_core.nn.hf import save_hf_model
    from grpo_core.nn.model import create_model

    folder, out = str(tmp_path / "model"), str(tmp_path / "load.json")
    save_hf_model(create_model(get_preset("tiny", vocab_size=64), 0), folder)
    run_with_devices(8, f"import tests.test_sharding as t; t.load_child({folder!r}, {out!r})")
    with open(out) as f:
        res = json.load(f)
    assert res["devices"] == 8
    params = res["params"]
    assert all(p["as_placed"] and p["equal"] and p["devices"] == 8 for p in params.values()), params
    q = params["model.layers.self_attn.q_proj.kernel"]
    assert q["spec"] == [None, "fsdp", "tensor"] and q["shard"] == [
        q["shape"][0],
        q["shape"][1] // 2,
        q["shape"][2] // 2,
    ]
    assert params["model.embed_tokens.embedding"]["spec"] == ["tensor", "fsdp"]
