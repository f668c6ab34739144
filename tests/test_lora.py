"""LoRA: adapters off is the base exactly, merged equals unmerged, only adapters train and are
checkpointed (with optimizer state for them alone), resume is exact, the reference is the base
without a copy, a LoRA run's export loads in transformers with the merged policy's logits, and
bad `model.lora` values fail naming the field."""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_core.config.presets import get_preset
from grpo_core.config.run import RunConfig, load_config
from grpo_core.errors import ConfigError
from grpo_core.nn import lora
from grpo_core.nn.model import create_model
from grpo_core.rl.checkpoint import Checkpointer
from grpo_core.rl.trainer import GRPOTrainer
from grpo_core.testing import SYNTHETIC_DEFAULT, build_synthetic

QV = ".*(q_proj|v_proj).*"


def tiny(seed=0, **fields):
    return create_model(get_preset("tiny", **fields), seed)


def ids(shape=(2, 11), seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 384, shape))


def perturb(adapters, scale=0.05, seed=1):
    """Adapters as after some training: B no longer zero."""
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def paths(state) -> set:
    return {p for p, _ in nnx.to_flat_state(state)}


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_adapters_off_is_the_base_exactly():
    x = ids()
    m = tiny()
    base = np.asarray(m(x))
    lora.apply(m, lora.LoraConfig(rank=4, alpha=8, target_modules=QV))
    assert sorted(lora._linears(m)) == sorted(lora.LAYER_LINEARS)  # the config validates against these
    # fresh adapters (B = 0) add nothing: bit-equal on CPU; a GPU may order the sums differently
    np.testing.assert_allclose(np.asarray(m(x)), base, rtol=0, atol=1e-6)
    parts = lora.split(m)
    assert sorted("/".join(map(str, p)) for p in paths(parts.adapters)) == [
        f"model/layers/self_attn/{m}/lora_{ab}" for m in ("q_proj", "v_proj") for ab in "ab"
    ]
    assert parts.adapters["model"]["layers"]["self_attn"]["q_proj"]["lora_a"].shape == (2, 128, 4)  # (L, in, r)
    assert parts.adapters["model"]["layers"]["self_attn"]["v_proj"]["lora_b"].shape == (2, 4, 64)  # (L, r, out)
    trained = perturb(parts.adapters)
    policy = nnx.merge(parts.graphdef, parts.base, trained)
    assert np.abs(np.asarray(policy(x)) - base).max() > 1e-3  # the adapters do something ...
    off = nnx.merge(parts.base_graphdef, parts.base)  # ... and switched off, the base is back, bit for bit
    np.testing.assert_array_equal(np.asarray(off(x)), base)
    assert not lora.has_adapters(off) and lora.has_adapters(policy)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_model_equals_the_adapter_model(dtype):
    m = tiny(dtype=dtype, param_dtype=dtype, tie_word_embeddings=False, attention_bias=True)
    lora.apply(m, lora.LoraConfig(rank=8, alpha=32))  # every linear
    parts = lora.split(m)
    policy = nnx.merge(parts.graphdef, parts.base, perturb(parts.adapters))
    kernel_before = np.asarray(policy.model.layers.mlp.up_proj.kernel[...].astype(jnp.float32))
    merged = lora.merge(policy)
    assert not lora.has_adapters(merged) and lora.has_adapters(policy)
    # `policy` is untouched: merge replaces kernels in its own copy
    np.testing.assert_array_equal(
        np.asarray(policy.model.layers.mlp.up_proj.kernel[...].astype(jnp.float32)), kernel_before
    )
    assert merged.model.layers.mlp.up_proj.kernel.dtype == jnp.dtype(dtype)
    assert paths(nnx.state(merged)) == paths(parts.base)  # plain model again
    x = ids(seed=3)
    want, got = np.asarray(policy(x)), np.asarray(merged(x))
    if dtype == "float32":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    else:  # bf16 kernels: W + sAB is rounded once more than W and sAB apart
        assert np.abs(got - want).max() / np.abs(want).max() < 0.05


def lora_trainer(steps=4, beta=0.1, lr=2e-2, lora_cfg=None):
    cfg = copy.deepcopy(SYNTHETIC_DEFAULT)
    cfg["train"]["num_steps"] = steps
    cfg["train"]["grpo"].update(beta=beta, prompts_per_step=8)
    cfg["train"]["optimizer"].update(learning_rate=lr, warmup_steps=0)
    run = build_synthetic(cfg)
    lora.apply(run.model, lora_cfg or lora.LoraConfig(rank=4, alpha=8))
    return GRPOTrainer(run.model, run.train, run.tokenizer, run.rewards, run.task)


def test_grpo_trains_only_the_adapters_against_the_base_as_reference():
    tr = lora_trainer()
    base = jax.tree.map(np.array, tr.frozen)
    start = jax.tree.map(np.array, tr.state["params"])
    assert tr.ref_params is tr.frozen  # the reference is the base itself, not a copy
    hist = tr.train()
    assert hist[0]["kl"] == 0.0  # B = 0: the policy is the base, scored by another graph, exactly
    assert all(np.isfinite(m["loss"]) for m in hist) and hist[-1]["kl"] > 1e-5 and hist[-1]["grad_norm"] > 0
    jax.tree.map(np.testing.assert_array_equal, base, jax.tree.map(np.asarray, tr.frozen))  # bit-identical
    b = tr.state["params"]["model"]["layers"]["mlp"]["down_proj"]["lora_b"]
    assert (
        np.abs(np.asarray(b)).max() > 0
        and np.abs(np.asarray(start["model"]["layers"]["mlp"]["down_proj"]["lora_b"])).max() == 0
    )
    # What trains and what the optimizer keeps: the adapters (and AdamW's two moments of them).
    adapters = nbytes(tr.state["params"])
    # L * r * (in + out) over q, k, v, o, gate, up, down
    assert lora.num_params(tr.state["params"]) == 2 * 4 * (256 + 192 + 192 + 256 + 3 * 384)
    assert adapters < 0.1 * nbytes(tr.frozen)
    assert 2 * adapters <= nbytes(tr.state["opt_state"]) <= 2 * adapters + 64
    # The policy the sampler sees is base + adapters.
    assert paths(tr.params) == paths(tr.frozen) | paths(tr.state["params"])


def test_checkpoint_holds_only_adapters_and_resume_is_exact(tmp_path):
    straight = lora_trainer(steps=4, beta=0.05)
    hist = straight.train(2)
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        straight.save(ckpt, config_hash="h")
        ckpt.wait()
        saved, meta = ckpt.restore(2)  # as stored, no target
    assert meta["step"] == 2
    flat = [
        tuple(str(getattr(k, "key", k)) for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(saved["params"])[0]
    ]
    assert flat and all(p[-2] in ("lora_a", "lora_b") for p in flat), flat  # no base weight saved
    assert nbytes(saved) < 0.5 * nbytes(straight.frozen)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "ckpt" / "2").rglob("*") if f.is_file())
    assert on_disk < nbytes(straight.frozen), on_disk
    hist += straight.train(4)

    resumed = lora_trainer(steps=4, beta=0.05)  # base rebuilt from preset + seed, adapters loaded
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        assert resumed.restore(ckpt, config_hash="h") and resumed.step == 2
    again = resumed.train(4)
    for a, b in zip(hist[2:], again):
        for k in ("reward", "loss", "kl", "grad_norm"):
            assert a[k] == b[k], (k, a[k], b[k])
    jax.tree.map(
        np.testing.assert_array_equal, jax.tree.map(np.asarray, straight.state), jax.tree.map(np.asarray, resumed.state)
    )


def test_lora_config_errors_name_the_field():
    cases = {
        "model.lora.rank=0": "model.lora.rank must be >= 1, got 0",
        "model.lora.rank=two": "model.lora.rank must be int, got 'two'",
        "model.lora.alpha=-1": "model.lora.alpha must be > 0, got -1.0",
        "model.lora.target_modules=.*(q_proj": (
            "model.lora.target_modules '.*(q_proj' is not a valid regular expression"
        ),
        "model.lora.target_modules=.*(qkv_proj).*": (
            "model.lora.target_modules '.*(qkv_proj).*' matches none of the "
            "modules q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
            "down_proj (it is searched in paths like "
            "model.layers.self_attn.q_proj)"
        ),
        "model.lora.dropout=0.05": (
            "model.lora.dropout must be in [0, 0], got 0.05 "
            "(Adapter dropout: only 0, since dropout in the update alone would bias GRPO"
        ),
        "model.lora.r=8": "model.lora: unknown field(s) ['r']; known: ['alpha', 'dropout', 'rank', 'target_modules']",
        "model.lora=8": "model.lora must be a mapping",
    }
    for override, msg in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        assert msg in str(err.value), (override, str(err.value))


def test_lora_in_the_run_config_form_and_hash():
    plain = RunConfig.from_dict({})
    cli = load_config(None, ["model.lora.rank=8", f"model.lora.target_modules={QV}"])
    yaml_cfg = RunConfig.from_dict({"model": {"lora": {"rank": 8, "alpha": 16, "target_modules": QV}}})
    assert cli.model.to_dict()["lora"] == {"rank": 8, "alpha": 16.0, "target_modules": QV, "dropout": 0.0}
    assert cli.train_hash == yaml_cfg.train_hash != plain.train_hash
    assert load_config(None, ["model.lora.rank=16"]).train_hash != cli.train_hash
    assert RunConfig.from_dict({"model": {"lora": None}}).train_hash == plain.train_hash  # null: full fine-tuning
    assert json.loads(json.dumps(cli.to_dict()))["model"]["lora"]["rank"] == 8

    from flows.params import RunParams

    form = RunParams.model_validate({"model": {"lora": {"rank": 8, "target_modules": QV}}}).to_config()
    assert form.train_hash == cli.train_hash
    assert RunParams.model_validate({"model": {"lora": None}}).to_config().train_hash == plain.train_hash
    schema = RunParams.model_json_schema()
    lora_schema = schema["$defs"]["LoraParams"]["properties"]
    assert lora_schema["rank"]["minimum"] == 1 and "alpha / rank" in lora_schema["alpha"]["description"]
    with pytest.raises(Exception, match="greater than or equal to 1"):
        RunParams.model_validate({"model": {"lora": {"rank": 0}}})


@pytest.mark.slow  # end to end: train, evaluate and export workers (~25 s); make test runs it
def test_lora_run_evaluates_and_exports_a_merged_model_transformers_loads(tmp_path):
    """Train a LoRA run on a tiny Qwen3 folder with the worker's own stages; evaluate and export
    from its adapter-only checkpoint; transformers loads the export with the merged policy's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from grpo_core.data.prepare import prepare_dataset
    from grpo_core.data.tokenizer import make_tokenizer
    from grpo_core.nn.hf import load_hf_model
    from grpo_core.stages import worker
    from grpo_core.stages.parts import open_run
    from grpo_core.store.runs import init_run_root
    from tests.hf_models import build_hf_model

    folder = tmp_path / "tiny-qwen3"
    build_hf_model(folder, "qwen3")
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"Repeat: {w}", "answer": w}) + "\n"
            for w in ["cat", "dog", "sun", "sky", "tree", "moon", "fish", "bird"]
        )
    )
    (tmp_path / "reward.py").write_text(
        "def letters(prompts, completions, answer, **_):\n"
        "    return [len(set(c) & set(a)) / len(set(a)) for c, a in zip(completions, answer)]\n"
    )
    cfg = RunConfig.from_dict(
        {
            "run_name": "lora",
            "storage": {"root": str(tmp_path / "runs")},
            "model": {
                "path": str(folder),
                "lora": {"rank": 4, "alpha": 8, "target_modules": ".*(q_proj|v_proj|up_proj).*"},
            },
            "data": {"source": str(data), "eval_fraction": 0.25},
            "rewards": [{"function": f"{tmp_path}/reward.py:letters"}],
            "train": {
                "num_steps": 2,
                "seed": 1,
                "grpo": {"prompts_per_step": 2, "num_generations": 4, "beta": 0.05},
                "sampling": {"max_new_tokens": 6},
                "optimizer": {"learning_rate": 5e-2, "warmup_steps": 0},
            },
            "eval": {"num_samples": 1, "batch_size": 4},
            "pipeline": {"epochs": 1, "checkpoint_every": 2},
        }
    )
    root = init_run_root(cfg)
    prepare_dataset(cfg.data, make_tokenizer(cfg), root, cfg.tokenizer_id)
    parts = open_run(cfg, root)
    assert worker.train(parts, 2) == 0
    assert worker.evaluate_steps(parts, [2]) == 0 and 0 <= root.read_json("eval/2.json")["accuracy"] <= 1
    assert worker.export(parts, None) == 0
    assert root.done_info("export/2")["lora_merged"] is True

    with Checkpointer(root.uri("checkpoints")) as ckpt:
        policy = nnx.merge(*parts.policy_at(ckpt, 2))
    assert lora.has_adapters(policy)
    export = str(tmp_path / "runs" / "lora" / "export" / "2")
    start, exported = load_hf_model(str(folder)), load_hf_model(export)
    moved = [
        float(jnp.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(nnx.state(start)), jax.tree.leaves(nnx.state(exported)))
    ]
    assert max(moved) > 0  # the adapters were trained and merged in
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    x = np.asarray([parts.train_rows[0]["prompt_ids"]])
    with torch.no_grad():
        ref = hf(torch.tensor(x)).logits.numpy()
    merged = np.asarray(lora.merge(policy)(jnp.asarray(x)))
    assert np.abs(merged - ref).max() / np.abs(ref).max() < 1e-4
    np.testing.assert_allclose(np.asarray(policy(jnp.asarray(x))), merged, rtol=1e-5, atol=1e-5 * np.abs(merged).max())


def test_memory_plan_counts_adapters_not_a_second_model():
    from grpo_core.config import memory
    from grpo_core.config.train import TrainConfig
    from grpo_core.stages.readiness import parse_request

    mc = get_preset("qwen3-0.6b")
    cfg = lora.LoraConfig(rank=8, target_modules=QV)
    abstract = nnx.eval_shape(lambda: lora.apply(create_model(mc), cfg))
    n = lora.num_adapter_params(mc, cfg)
    assert n == lora.num_params(nnx.state(abstract, nnx.LoRAParam)) == 28 * 8 * (1024 + 2048 + 1024 + 1024)
    train = TrainConfig.from_dict({"grpo": {"beta": 0.04, "grad_accum_steps": 1}, "remat": "full"})
    facts = {"backend": "cpu", "available": None, "devices": 1}
    full, adapted = (
        memory.plan_on(mc, train, 64, facts).estimate,
        memory.plan_on(mc, train, 64, facts, lora=cfg).estimate,
    )
    t, f = adapted.terms, full.terms
    assert t["gradients"] == 4 * n and t["optimizer"] == 8 * n and t["reference"] == 0 < f["reference"]
    assert t["params"] == f["params"] + 4 * n and t["kv_cache"] == f["kv_cache"]
    assert full.total - adapted.total > 3 * mc.num_params() * 2  # grads + moments + reference
    # a continual run's base as the KL reference (model.reference: base) is weights of its own
    based = memory.plan_on(mc, train, 64, facts, lora=cfg, separate_reference=True).estimate
    assert based.terms["reference"] == f["reference"] and based.total == adapted.total + f["reference"]
    req = {"model": mc.to_dict(), "train": train.to_dict(), "max_prompt_tokens": 64}
    assert parse_request(dict(req, lora={"rank": 8, "target_modules": QV}))["lora"] == cfg
    with pytest.raises(ConfigError, match="model.lora.rank must be >= 1, got 0"):
        parse_request(dict(req, lora={"rank": 0}))


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_pipeline_with_lora_resumes_and_exports_merged(tmp_path, monkeypatch):
    """The whole flow with model.lora and a KL term; its worker is killed after step 5 and
    resumes from checkpoint 4: checkpoints hold adapters only, readiness budgets no
    reference copy, and the export is the merged policy, as transformers computes it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from grpo_core.stages.parts import open_run
    from grpo_core.store.root import RunRoot
    from tests.faults import HOOK
    from tests.test_pipeline import NUM_STEPS, run_pipeline, small_config

    monkeypatch.setenv("GRPO_TEST_HOOK", HOOK)
    monkeypatch.setenv("GRPO_FAULT", f"step:5:{tmp_path}/fault")
    cfg = small_config(
        str(tmp_path),
        "lora",
        model={"lora": {"rank": 4, "alpha": 8, "target_modules": QV}},
        train={
            "num_steps": NUM_STEPS,
            "grpo": {"prompts_per_step": 4, "beta": 0.04},
            "optimizer": {"learning_rate": 1e-2},
        },
        eval={"num_samples": 1},
        pipeline={"epochs": 1},
    )
    s = run_pipeline(cfg)
    run = RunRoot(str(tmp_path / "lora"))
    assert s["status"] == "completed" and s["steps"] == NUM_STEPS and (tmp_path / "fault").exists()
    assert [m["step"] for m in run.read_metrics()] == list(range(NUM_STEPS))
    parts = open_run(RunConfig.from_dict(run.read_json("config.json")), run)
    terms = run.read_json("readiness.json")["memory"]["terms_bytes"]
    adapters = lora.num_adapter_params(parts.model_config(), lora.LoraConfig(rank=4, target_modules=QV))
    assert terms["reference"] == 0 and terms["optimizer"] == 8 * adapters
    with Checkpointer(run.uri("checkpoints")) as ckpt:
        saved, _ = ckpt.restore(NUM_STEPS)
    leaves = jax.tree_util.tree_flatten_with_path(saved["params"])[0]
    assert leaves and all(str(p[-2].key) in ("lora_a", "lora_b") for p, _ in leaves)
    assert run.done_info(f"export/{NUM_STEPS}")["lora_merged"] is True

    with Checkpointer(run.uri("checkpoints")) as ckpt:
        policy = nnx.merge(*parts.policy_at(ckpt, NUM_STEPS))
    hf = transformers.AutoModelForCausalLM.from_pretrained(f"{run.url}/export/{NUM_STEPS}", dtype=torch.float32).eval()
    x = np.asarray([parts.tokenizer.encode("abc=cba")])
    with torch.no_grad():
        ref = hf(torch.tensor(x)).logits.numpy()
    got = np.asarray(lora.merge(policy)(jnp.asarray(x)))
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4
