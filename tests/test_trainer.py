import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_core.config.train import GRPOConfig, LossAggregation, OptimizerConfig
from grpo_core.rewards.functions import Reward
from grpo_core.rl.learner import Learner, LossParams
from grpo_core.rl.trainer import GRPOTrainer, NonFiniteError
from grpo_core.testing import SYNTHETIC_DEFAULT, build_synthetic
from tests.cpu_devices import run_with_devices


def make(steps=3, rewards=None, **train):
    cfg = copy.deepcopy(SYNTHETIC_DEFAULT)
    cfg["train"]["num_steps"] = steps
    for section, values in train.items():
        cfg["train"].setdefault(section, {}).update(values)
    run = build_synthetic(cfg)
    return GRPOTrainer(run.model, run.train, run.tokenizer, rewards or run.rewards, run.task), run


TRL_KEYS = [
    "reward",
    "reward_std",
    "rewards/char_match/mean",
    "rewards/char_match/std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "kl",
    "entropy",
    "clip_ratio_low",
    "clip_ratio_high",
    "grad_norm",
    "learning_rate",
    "rollout_tokens_per_s",
    "time/rollout",
    "time/rewards",
    "time/reference",
    "time/update",
    "time/step",
]


def test_trainers_of_one_config_share_the_learners_programs():
    """A stage in a worker that stayed builds its trainer again: with the same config it gets the
    learner the stage before built (its programs traced and compiled: one update program, not a
    second) and trains as a fresh one does; another config gets a learner of its own."""
    a, _ = make(steps=2)
    a.train_step()
    # the process's learner cache may hold programs of earlier tests with this config: counted here
    programs = a.learner.update._cache_size()
    b, _ = make(steps=2)
    assert b.learner is a.learner
    b.train_step()
    assert b.learner.update._cache_size() == programs
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a.params), jax.device_get(b.params))
    c, _ = make(steps=2, optimizer={"learning_rate": 0.5})
    assert c.learner is not a.learner


def test_metrics_and_no_reference_when_beta_is_zero():
    tr, _ = make(steps=2)
    assert tr.ref_params is None
    hist = tr.train()
    assert [int(m["step"]) for m in hist] == [0, 1] and tr.step == 2
    for k in TRL_KEYS:
        assert k in hist[-1] and np.isfinite(hist[-1][k]), k
    assert hist[-1]["kl"] == 0.0 and hist[-1]["time/reference"] == 0.0
    assert 1 <= hist[-1]["completions/min_length"] <= hist[-1]["completions/max_length"] <= 6
    assert hist[-1]["learning_rate"] > 0


def test_reference_and_kl_with_beta():
    tr, _ = make(steps=4, grpo={"beta": 0.1, "kl_estimator": "k3"}, optimizer={"learning_rate": 1e-2})
    hist = tr.train()
    assert tr.ref_params is not None
    assert hist[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # the policy is the reference at step 0
    assert hist[-1]["kl"] > 1e-4  # ... and has moved away after updates
    assert hist[-1]["time/reference"] > 0


def test_same_seed_same_run_and_keys_differ_per_step():
    a, _ = make(steps=2)
    b, _ = make(steps=2)
    ha, hb = a.train(), b.train()
    for k in ("reward", "loss", "grad_norm", "entropy"):
        assert ha[1][k] == hb[1][k], k
    ro0, _ = a.rollout(5)
    ro1, _ = a.rollout(6)
    assert not np.array_equal(ro0.completions.tokens, ro1.completions.tokens)


def test_nan_is_reported_with_step_and_metric():
    tr, _ = make(steps=5, optimizer={"learning_rate": 1e30, "max_grad_norm": None, "warmup_steps": 0})
    with pytest.raises(NonFiniteError, match=r"step \d+: (loss|grad_norm|kl|entropy) is nan"):
        tr.train()


def test_dynamic_sampling_drops_zero_variance_groups():
    # Prompts that start with 'a' always score 1: their groups have zero variance.
    def flat_for_a(prompts, completions, answer, **_):
        return [
            1.0 if p.startswith("a") else float(c == a) + 0.1 * len(c) for p, c, a in zip(prompts, completions, answer)
        ]

    tr, _ = make(steps=1, rewards=[Reward(flat_for_a)], grpo={"dynamic_sampling": True, "max_sampling_rounds": 4})
    ro, info = tr.rollout(0)
    g = tr.cfg.grpo.num_generations
    zero = [np.ptp(ro.rewards[i * g : (i + 1) * g]) == 0 for i in range(len(ro.rows))]
    starts_a = [r["prompt"].startswith("a") for r in ro.rows]
    assert info["sampling_rounds"] >= 2 or not any(starts_a)
    # zero-variance groups only fill up what the rounds could not
    assert sum(zero) <= sum(starts_a) and ro.completions.tokens.shape[0] == tr.cfg.grpo.batch_size
    if info["sampling_rounds"] < 4:
        assert not any(zero)
    assert ro.prompt_tokens.shape[0] == len(ro.rows) == tr.cfg.grpo.prompts_per_step
    for i, row in enumerate(ro.rows):  # each group's prompt stays with its row after the merge
        assert tr.tokenizer.decode(ro.prompt_tokens[i][ro.prompt_valid[i]]) == row["prompt"]
    assert np.isfinite(tr.train_step()["loss"])


def _learner_batch(tr):
    ro, _ = tr.rollout(0)
    return tr._batch(ro)


@pytest.mark.parametrize(
    "agg", [LossAggregation.TOKEN_MEAN, LossAggregation.SEQ_MEAN_TOKEN_MEAN, LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM]
)
def test_gradient_accumulation_matches_one_big_batch(agg):
    tr, _ = make(steps=1)
    batch = _learner_batch(tr)
    out = []
    for accum in (1, 4):
        hp = LossParams.from_config(GRPOConfig(loss_aggregation=agg, grad_accum_steps=accum), 6, 1.0)
        # A large Adam eps keeps the first update ~linear in the gradient (with eps=1e-8 it is
        # lr * sign(g), which turns last-bit differences of near-zero gradients into lr-sized ones).
        learner = Learner(tr.graphdef, OptimizerConfig(learning_rate=1e-3, eps=1e-3), hp, 10)
        state = learner.init_state(jax.tree.map(jnp.copy, tr.params))
        state, m = learner.update(state, batch)
        out.append((state["params"], m))
    (p1, m1), (p4, m4) = out
    assert float(m1["loss"]) == pytest.approx(float(m4["loss"]), rel=1e-4, abs=1e-6)
    assert float(m1["grad_norm"]) == pytest.approx(float(m4["grad_norm"]), rel=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), p1, p4)


def test_second_iteration_is_off_policy():
    """With num_iterations > 1 the old log-probs are the rollout's, so after one update the ratio moves."""
    tr, _ = make(steps=1)
    batch = _learner_batch(tr)
    hp = LossParams.from_config(GRPOConfig(grad_accum_steps=1), 6, 1.0)
    learner = Learner(tr.graphdef, OptimizerConfig(learning_rate=1e-2), hp, 10)
    state = learner.init_state(jax.tree.map(jnp.copy, tr.params))
    state, m1 = learner.update(state, batch)
    state, m2 = learner.update(state, batch)
    assert float(m1["ratio_mean"]) == pytest.approx(1.0, abs=1e-4)  # on-policy: rollout == policy
    assert abs(float(m2["ratio_mean"]) - 1.0) > 1e-3


def test_iterations_and_minibatches_run_every_update():
    tr, _ = make(
        steps=2,
        grpo={
            "num_iterations": 2,
            "minibatches_per_rollout": 2,
            "grad_accum_steps": 2,
            "mask_truncated_completions": True,
            "ratio_level": "sequence",
        },
    )
    hist = tr.train()
    assert int(tr.state["step"]) == 2 * 2 * 2  # steps x iterations x minibatches optimizer updates
    assert np.isfinite(hist[-1]["loss"])


@pytest.mark.slow
def test_tiny_preset_learns_the_synthetic_task():
    # up to 600 steps compute more than they compile: with XLA's optimised code, so in a child process
    # (tests/conftest.py compiles this one's programs for compile time)
    run_with_devices(1, "import tests.test_trainer as t; t.learn()", timeout_s=1200, optimized=True)


def learn():
    """Within the config's 600 steps, the mean reward of 50 steps in a row climbs from under 0.2 to
    over 0.5 (near step 350 here); it stops once it has."""
    tr, run = make(steps=600)
    rewards = []
    while tr.step < 600 and (len(rewards) < 100 or np.mean(rewards[-50:]) <= 0.5):
        rewards.append(tr.train_step()["reward"])
    first, last = np.mean(rewards[:50]), np.mean(rewards[-50:])
    assert first < 0.2, first
    assert last > 0.5, (first, last, len(rewards))


def test_bf16_model_trains():
    cfg = copy.deepcopy(SYNTHETIC_DEFAULT)
    cfg["model"].update(dtype="bfloat16", param_dtype="bfloat16")
    cfg["train"].update(num_steps=2)
    run = build_synthetic(cfg)
    tr = GRPOTrainer(run.model, run.train, run.tokenizer, run.rewards, run.task)
    hist = tr.train()
    assert all(np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]) for m in hist)
    assert jax.tree.leaves(tr.params)[0].dtype == jnp.bfloat16


def test_mixed_precision_keeps_f32_master_weights_and_rescores_old_logprobs():
    cfg = copy.deepcopy(SYNTHETIC_DEFAULT)
    cfg["model"].update(dtype="bfloat16", param_dtype="float32")
    cfg["train"].update(num_steps=2)
    cfg["train"]["grpo"]["beta"] = 0.04
    cfg["train"]["optimizer"]["mu_dtype"] = "bfloat16"
    run = build_synthetic(cfg)
    tr = GRPOTrainer(run.model, run.train, run.tokenizer, run.rewards, run.task)
    assert tr.rescore  # bf16: the sampler's decode rounds differently from the learner's forward
    hist = tr.train()
    dtypes = lambda tree: {str(x.dtype) for x in jax.tree.leaves(tree) if x.ndim >= 2}
    assert dtypes(tr.state["params"]) == {"float32"}  # master weights
    mu, nu = (optax.tree_utils.tree_get(tr.state["opt_state"], k) for k in ("mu", "nu"))
    assert dtypes(mu) == {"bfloat16"} and dtypes(nu) == {"float32"}
    assert dtypes(tr.ref_params) == {"bfloat16"}  # the reference as the matmuls read it: half the memory
    assert tr.rescore_in_update  # one update per rollout: in the update's own forward, no pass of its own
    for m in hist:
        assert np.isfinite(m["loss"]) and m["time/rescore"] == 0
        # the engine's bf16 log-probs against the learner's, on the same tokens: close, not equal
        assert 0 < m["logprobs/sampler_gap_mean"] <= m["logprobs/sampler_gap_max"] < 0.5
        assert m["rollout_is/weight_mean"] == pytest.approx(1.0, abs=0.05) and m["ratio_mean"] == 1.0
    # float32 end to end: the sampler's own log-probs are kept (they agree to ~1e-6, tests/test_sampler.py)
    f32 = make(steps=1)[0]
    assert not f32.rescore and "logprobs/sampler_gap_mean" not in f32.train()[0]
