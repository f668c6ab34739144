"""Reward models in the config (issue 64): `rewards: [{model: FOLDER_OR_ID}]` beside functions, its
settings and errors naming the field, the name it is logged under (TRL's: the id's last part),
its version in the run's identity (a rebuilt folder is a new run), the registry's check of its
config.json, what the memory plan counts of it, and what it reads (TRL's texts). JAX-free: the
Prefect side makes these."""

import pytest
from safetensors.numpy import load_file

from grpo_core.config import memory
from grpo_core.config.presets import get_preset
from grpo_core.config.run import RunConfig, load_config
from grpo_core.config.train import RematPolicy, TrainConfig
from grpo_core.errors import ConfigError
from grpo_core.nn.tiny_hf import write_tiny_model
from grpo_core.resolve import resolve_run
from grpo_core.rewards.registry import config_rewards, make_rewards
from grpo_core.rewards.reward_model import ModelReward, config_shapes


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    """`grpo tiny-model --reward-model`'s folder (numpy and tokenizers: no JAX, no PyTorch)."""
    return write_tiny_model(tmp_path_factory.mktemp("rm") / "tiny-rm", arch="qwen2", reward_model=True)


def test_a_reward_is_a_function_or_a_model(rm):
    cfg = RunConfig.from_dict({"rewards": [{"model": f"{rm}/", "weight": 0.5, "clip": [-3, 3]}, "char_match"]})
    spec = cfg.rewards[0]
    assert spec.name == "tiny-rm" and cfg.eval.accuracy_reward == "tiny-rm"  # TRL: the id's last part
    assert (spec.model_batch_size, spec.model_max_length, spec.clip) == (8, 1024, (-3.0, 3.0))
    assert cfg.reward_models == (("rewards[0].model", spec),) and cfg.code == (("rewards[1].function", "char_match"),)
    # a function's spec as before reward models: its dict, and so every hash of a run without one
    assert cfg.to_dict()["rewards"][1] == {"function": "char_match", "weight": 1.0, "params": None}
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    from flows.params import RunParams  # the run form (a deployment's parameters) holds it as it is

    assert RunParams.model_validate(cfg.to_dict()).to_config() == cfg
    for given, message in [
        ({"model": "x", "function": "y"}, r"rewards\[0\] must name a function or a model \(one of them\)"),
        ({"weight": 2}, r"rewards\[0\] must name a function or a model .* neither"),
        ({"function": "char_match", "max_length": 64}, r"rewards\[0\]\.max_length applies to a reward model"),
        ({"model": "x", "params": {"k": 1}}, r"rewards\[0\]\.params are a function's keywords"),
        ({"model": "x", "clip": [2, 1]}, r"rewards\[0\]\.clip must be \[low, high\] with low < high"),
        ({"model": "x", "batch_size": 0}, r"rewards\[0\]\.batch_size must be >= 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            RunConfig.from_dict({"rewards": [given]})


def test_a_rebuilt_reward_model_is_a_new_run(rm, tmp_path):
    """Its folder's version is recorded as model.path's is, in the training and evaluation hashes."""
    sets = [f"storage.root={tmp_path}", f"rewards=[{{model: {rm}}}]"]
    first = resolve_run(load_config(None, sets))
    assert dict(first.versions)["rewards[0].model"].startswith("files:")
    again = resolve_run(load_config(None, sets))
    assert (again.train_hash, again.eval_hash) == (first.train_hash, first.eval_hash)
    (rm / "notes.txt").write_text("retrained")
    try:
        rebuilt = resolve_run(load_config(None, sets))
    finally:
        (rm / "notes.txt").unlink()
    assert rebuilt.train_hash != first.train_hash and rebuilt.eval_hash != first.eval_hash
    assert rebuilt.name != first.name
    plain = resolve_run(load_config(None, [f"storage.root={tmp_path}"]))
    assert "rewards[0].model" not in dict(plain.versions)


def test_the_registry_checks_its_config_json(rm, tmp_path):
    rewards, evals = config_rewards(RunConfig.from_dict({"rewards": [{"model": str(rm), "weight": 2}]}))
    [r] = rewards
    assert r.model and r.name == "tiny-rm" and r.weight == 2 and r.field == "rewards[0].model"
    assert evals[0].model and evals[0].fn is not r.fn  # made again for evaluation: one weights copy (open_scorer)
    assert "rewards[0].model" in r.describe()
    causal = tmp_path / "causal"
    write_tiny_model(causal, arch="qwen2")
    with pytest.raises(ConfigError, match=r"^rewards\[0\]\.model .*not a sequence classifier.*Qwen2ForSequenceClass"):
        make_rewards(RunConfig.from_dict({"rewards": [{"model": str(causal)}]}).rewards)
    with pytest.raises(ConfigError, match=r"^rewards\[0\]\.model '/nowhere/rm': /nowhere/rm does not exist"):
        make_rewards(RunConfig.from_dict({"rewards": [{"model": "/nowhere/rm"}]}).rewards)
    assert make_rewards(RunConfig.from_dict({"rewards": [{"model": "/nowhere/rm"}]}).rewards, skip_missing=True) == []


def test_the_memory_plan_counts_its_weights_and_its_batches(rm):
    """Its weights stay resident (in the run's dtype); scoring a batch is a phase of its own, which
    grows with batch_size x max_length; a run without one reports the terms it always did."""
    cfg = RunConfig.from_dict({"rewards": [{"model": str(rm), "batch_size": 16, "max_length": 4096}]})
    [shape] = config_shapes(cfg)
    assert (shape.batch_size, shape.max_length, shape.config.dtype.value) == (16, 4096, "float32")
    n = shape.config.num_params()
    weights = load_file(str(rm / "model.safetensors"))
    assert "lm_head.weight" not in weights and n == sum(w.size for w in weights.values()) - weights["score.weight"].size
    mc, train = get_preset("small", vocab_size=384), TrainConfig()
    plain = memory.estimate(mc, train, 16, remat=RematPolicy.DOTS, grad_accum_steps=1)
    with_rm = memory.estimate(mc, train, 16, remat=RematPolicy.DOTS, grad_accum_steps=1, reward_models=(shape,))
    assert "reward_models" not in plain.terms and "rewards" not in plain.phases
    assert with_rm.terms["reward_models"] == n * 4 and with_rm.resident == plain.resident + n * 4
    assert with_rm.peak_phase == "rewards" and with_rm.largest == "reward_activations"  # 16 x 4096 tokens
    plan = memory.plan(mc, train, 16, 1 << 30, reward_models=(shape,))
    assert not plan.fits and "lower rewards[].batch_size or rewards[].max_length" in plan.lever(train)
    small = memory.RewardModelShape(shape.config, 2, 256)
    assert memory.reward_forward_bytes(small) < memory.reward_forward_bytes(shape) / 100


def test_what_it_reads_is_what_trl_gives_a_reward_model(rm):
    """Chat data: the prompt's messages and the completion (or an episode) through its own chat
    template; plain data: prompt + completion; its own tokenizer, no special tokens added, a long
    text cut to its last max_length tokens."""
    from transformers import AutoTokenizer

    spec = RunConfig.from_dict({"rewards": [{"model": str(rm), "max_length": 12}]}).rewards[0]
    model = ModelReward(spec, "rewards[0].model")
    model.tokenizer = AutoTokenizer.from_pretrained(rm)
    chat = model.texts([[{"role": "user", "content": "2+2?"}]], [[{"role": "assistant", "content": "4"}]])
    assert chat == ["<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"]
    assert model.texts(["Q: 2+2? A:"], [" 4"]) == ["Q: 2+2? A: 4"]
    [ids] = model.encode(["Natalia sold 48 clips in April and half as many in May."])
    full = model.tokenizer("Natalia sold 48 clips in April and half as many in May.", add_special_tokens=False)
    assert len(full["input_ids"]) > 12 and ids == full["input_ids"][-12:]  # the end kept: it is what is scored
    with pytest.raises(RuntimeError, match=r"rewards\[0\]\.model .* is not loaded"):
        model(["p"], ["c"])


def test_grpo_check_names_each_reward_model(rm, tmp_path):
    """The readiness report's line per reward model (what it is, how it scores), a failed check
    naming the field for one that is not a classifier, and the shapes the device checks' plan counts."""
    from tasks.readiness import _reward_model_checks

    causal = write_tiny_model(tmp_path / "causal", arch="qwen2")
    cfg = RunConfig.from_dict(
        {"rewards": [{"model": str(rm), "clip": [-1, 1], "max_length": 256}, {"model": str(causal)}, "char_match"]}
    )
    checks: list = []
    shapes = _reward_model_checks(cfg, checks, parity=False, timeout_s=60)
    assert [s.max_length for s in shapes] == [256]
    good, bad = checks
    assert good["ok"] and good["detail"].startswith(f"rewards[0].model 'tiny-rm' ({rm}): 0.1 M parameters in float32")
    assert "batches of 8 texts of at most 256 tokens" in good["detail"] and "clipped to [-1.0, 1.0]" in good["detail"]
    assert (
        not bad["ok"] and bad["detail"].startswith("rewards[1].model") and "not a sequence classifier" in bad["detail"]
    )
    assert "ForSequenceClassification" in bad["fix"]


def test_a_reward_model_is_refused_with_the_split_layout():
    """The split layout's rollout process scores the rewards, and a reward model lives on the
    learner's devices: refused when the config is read, naming the way out."""
    from grpo_core.config.run import load_config
    from grpo_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rewards\[\]\.model is scored on the learner's devices.*layout: colocated"):
        load_config(None, ["rewards=[{model: /tmp/rm}]", "train.rollout.layout=split"])
    load_config(None, ["rewards=[{model: /tmp/rm}]", "train.max_staleness=1"])  # colocated: allowed
