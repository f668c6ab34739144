"""The loss and advantage variants users bring from TRL and verl, each pinned to numbers worked
by hand from the reference formula: CISPO, SAPO, the entropy bonus, TRL's top_entropy_quantile
mask, GDPO's normalize_then_sum, and the warning for GSPO with a token-level aggregation."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_core.config.model import DType
from grpo_core.config.run import RunConfig
from grpo_core.config.train import (
    GRPOConfig,
    ISCorrection,
    LossAggregation,
    OptimizerConfig,
    PolicyLoss,
    RatioLevel,
    RolloutConfig,
)
from grpo_core.data.synthetic import char_match, exact_match
from grpo_core.errors import ConfigError
from grpo_core.rewards.functions import Reward
from grpo_core.rl import algo
from grpo_core.rl.learner import Learner, LossParams
from tests.test_trainer import _learner_batch, make


def test_cispo_clips_the_weight_and_never_the_gradient():
    # rho = 3 (under the cap 5), A = 1, pi = 0.5: loss = -3 * 1 * log 0.5 = 2.0794; d/dlogp = -3
    # rho = 8 (over the cap): the weight is 5, and the gradient still flows: d/dlogp = -5 * A
    logp = jnp.log(jnp.array([[0.5, 0.5]]))
    log_r = jnp.log(jnp.array([[3.0, 8.0]]))
    adv = jnp.array([1.0])
    loss = algo.cispo_loss(logp, log_r, adv, 5.0)
    np.testing.assert_allclose(loss, [[-3 * math.log(0.5), -5 * math.log(0.5)]], rtol=1e-6)
    g_logp = jax.grad(lambda lp: algo.cispo_loss(lp, log_r, adv, 5.0).sum())(logp)
    np.testing.assert_allclose(g_logp, [[-3.0, -5.0]], rtol=1e-6)
    g_ratio = jax.grad(lambda lr: algo.cispo_loss(logp, lr, adv, 5.0).sum())(log_r)
    np.testing.assert_allclose(g_ratio, [[0.0, 0.0]])  # the weight is a constant


def test_sapo_gate_values_and_its_on_policy_gradient():
    sig = lambda x: 1 / (1 + math.exp(-x))
    # A = 1 at rho = 1, tau_pos = 1: -1 * sigmoid(0) * 4 = -2; A = -1 at rho = 1.5, tau_neg = 1.05
    log_r = jnp.log(jnp.array([[1.0], [1.5]]))
    adv = jnp.array([1.0, -1.0])
    got = algo.sapo_loss(log_r, adv, 1.0, 1.05)
    np.testing.assert_allclose(got, [[-2.0], [sig(1.05 * 0.5) * 4 / 1.05]], rtol=1e-6)
    # at rho = 1 the gradient in log rho is -A * tau * s(1-s) * 4 / tau = -A: the plain policy gradient
    g = jax.grad(lambda lr: algo.sapo_loss(lr, jnp.array([1.0, -1.0]), 1.0, 1.05).sum())(jnp.zeros((2, 1)))
    np.testing.assert_allclose(g, [[-1.0], [1.0]], rtol=1e-6)


def test_high_entropy_mask_keeps_the_top_quantile_of_real_tokens():
    ent = jnp.array([[0.1, 0.5, 0.9, 2.0], [0.3, 0.7, 9.0, 9.0]])
    mask = jnp.array([[1.0, 1, 1, 1], [1, 1, 0, 0]])  # the 9.0s are padding
    # real entropies 0.1 0.3 0.5 0.7 0.9 2.0; the 0.5 quantile (linear) is 0.6: 0.7, 0.9 and 2.0 stay
    got = algo.high_entropy_mask(ent, mask, 0.5)
    np.testing.assert_array_equal(got, [[0, 0, 1, 1], [0, 1, 0, 0]])
    assert float(algo.high_entropy_mask(ent, mask, 1.0).sum()) == 6  # 1.0 keeps every real token


def _gdpo_reference(per, w, g, eps=1e-4):
    """TRL's normalize_then_sum in numpy: group z-scores per reward (unbiased std, NaN left out),
    weighted nansum, then (x - batch mean) / (batch std + eps)."""
    p = per.reshape(-1, g, per.shape[1])
    mean = np.nanmean(p, axis=1, keepdims=True)
    std = np.nanstd(p, axis=1, ddof=1, keepdims=True)
    z = ((p - mean) / (std + eps)).reshape(per.shape)
    total = np.nansum(z * w, axis=1)
    return (total - total.mean()) / (total.std(ddof=1) + eps)


def test_normalize_then_sum_is_trls_gdpo():
    per = np.array([[1.0, 0.0], [0.0, 0.5], [1.0, 1.0], [1.0, 0.0]], np.float32)  # 2 groups of 2, 2 rewards
    w = np.array([1.0, 0.5], np.float32)
    got = np.asarray(algo.normalize_then_sum(jnp.asarray(per), jnp.asarray(w), 2))
    np.testing.assert_allclose(got, _gdpo_reference(per, w, 2), rtol=1e-4, atol=1e-5)
    # by hand: group 1 z-scores (+-0.7071 each reward), sums 0.7071 - 0.3536 and -0.7071 + 0.3536;
    # group 2: reward 0 is constant (z = 0), reward 1 +-0.7071 * 0.5; batch-normalised after
    assert got[0] == pytest.approx(-got[1]) and got[2] == pytest.approx(-got[3])
    # a reward that does not apply to a row (NaN) is left out of its group's statistics
    per_nan = per.copy()
    per_nan[0, 1] = np.nan
    got = np.asarray(algo.normalize_then_sum(jnp.asarray(per_nan), jnp.asarray(w), 2))
    assert np.all(np.isfinite(got))


def _update_loss(tr, batch, **grpo):
    hp = LossParams.from_config(GRPOConfig(grad_accum_steps=1, **grpo), 6, 1.0)
    learner = Learner(tr.graphdef, OptimizerConfig(learning_rate=1e-3), hp, 10)
    _, m = learner.update(learner.init_state(jax.tree.map(jnp.copy, tr.params)), batch)
    return m


def test_entropy_bonus_lowers_the_loss_by_coef_times_the_aggregated_entropy():
    tr, _ = make(steps=1)
    batch = _learner_batch(tr)
    plain = _update_loss(tr, batch)
    bonus = _update_loss(tr, batch, entropy_coef=0.01)
    weights = algo.token_weights(batch.mask, LossAggregation.SEQ_MEAN_TOKEN_MEAN, 1, 6)
    # the metrics' entropy is the token mean; the loss aggregates per sequence: recompute it
    m = _update_loss(tr, batch, entropy_coef=1.0)
    agg_entropy = float(plain["loss"]) - float(m["loss"])
    assert agg_entropy > 0 and float(plain["loss"]) - float(bonus["loss"]) == pytest.approx(
        0.01 * agg_entropy, rel=1e-3
    )
    assert float(jnp.sum(weights)) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("loss", [PolicyLoss.CISPO, PolicyLoss.SAPO])
def test_each_policy_loss_trains(loss):
    tr, _ = make(steps=1)
    batch = _learner_batch(tr)
    extra = {"epsilon_high": 5.0} if loss is PolicyLoss.CISPO else {}
    m = _update_loss(tr, batch, policy_loss=loss, top_entropy_quantile=0.2, **extra)
    assert np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0


def test_config_refuses_and_warns_like_trl():
    with pytest.raises(ConfigError, match=r"cispo caps the importance weight at grpo.epsilon_high .* got 0.2"):
        RunConfig.from_dict({"train": {"grpo": {"policy_loss": "cispo"}}})
    with pytest.raises(ConfigError, match=r"top_entropy_quantile"):
        RunConfig.from_dict({"train": {"grpo": {"top_entropy_quantile": 0}}})
    gspo = GRPOConfig(ratio_level=RatioLevel.SEQUENCE, loss_aggregation=LossAggregation.TOKEN_MEAN)
    assert any("GSPO" in w for w in gspo.warnings())
    assert GRPOConfig(ratio_level=RatioLevel.SEQUENCE).warnings() == []


def test_normalize_then_sum_in_a_training_step():
    rewards = [Reward(char_match, 1.0), Reward(exact_match, 0.5)]
    tr, _ = make(steps=1, rewards=rewards, grpo={"multi_objective_aggregation": "normalize_then_sum"})
    ro, _ = tr.rollout(0)
    batch = tr._batch(ro)
    per = np.stack([ro.per_function["char_match"], ro.per_function["exact_match"]], axis=1)
    want = _gdpo_reference(per, np.array([1.0, 0.5]), tr.cfg.grpo.num_generations)
    np.testing.assert_allclose(np.asarray(batch.advantages), np.nan_to_num(want), rtol=1e-4, atol=1e-4)


def test_rollout_weights_truncate_or_mask_per_token_or_sequence():
    # learner vs sampler log-probs: token ratios 0.5, 3.0 (masked pad after); sequence ratio 1.5
    learner = jnp.log(jnp.array([[0.25, 0.6, 0.9]]))
    sampler = jnp.log(jnp.array([[0.5, 0.2, 0.1]]))
    mask = jnp.array([[1.0, 1.0, 0.0]])
    w, m = algo.rollout_weights(learner, sampler, mask, ISCorrection.TOKEN_TRUNCATE, 2.0)
    np.testing.assert_allclose(w, [[0.5, 2.0, 0.0]], rtol=1e-6)  # 3.0 capped at C = 2; padding 0
    assert float(m["rollout_is/frac_capped"]) == pytest.approx(0.5)
    w, _ = algo.rollout_weights(learner, sampler, mask, ISCorrection.TOKEN_MASK, 2.0)
    np.testing.assert_allclose(w, [[0.5, 0.0, 0.0]], rtol=1e-6)  # above C: no loss at all
    w, m = algo.rollout_weights(learner, sampler, mask, ISCorrection.SEQUENCE_TRUNCATE, 2.0)
    np.testing.assert_allclose(w, [[1.5, 1.5, 0.0]], rtol=1e-5)  # 0.5 * 3.0, for every token
    assert float(m["rollout_is/frac_capped"]) == 0.0
    w, _ = algo.rollout_weights(learner, sampler, mask, ISCorrection.SEQUENCE_MASK, 1.2)
    np.testing.assert_allclose(w, [[0.0, 0.0, 0.0]])
    # k3 of KL(sampler || learner) on the sampled tokens: mean of e^x - x - 1, x = log(sampler/learner)
    xs = [math.log(0.5 / 0.25), math.log(0.2 / 0.6)]
    assert float(m["rollout_is/mismatch_kl"]) == pytest.approx(np.mean([math.exp(x) - x - 1 for x in xs]), rel=1e-5)


@pytest.mark.parametrize(
    "mode, accum", [(ISCorrection.TOKEN_TRUNCATE, 1), (ISCorrection.SEQUENCE_MASK, 2), (ISCorrection.OFF, 2)]
)
def test_rescoring_in_the_update_is_the_update_after_a_pass_of_its_own(mode, accum):
    """With one update per rollout the learner rescores old_logp in the update's own forward
    (TrainConfig.rescores_in_update): the same new parameters, loss, gradient norm and mismatch
    metrics as rescoring in a pass of its own, then weighing the batch. The sampler's log-probs
    are moved away from the policy's (noise of 0.3 nats) so that the correction caps and masks;
    two micro-batches add their sums (gap_max: the larger)."""
    tr, _ = make(steps=1)
    batch = _learner_batch(tr)
    sampler = batch.old_logp + 0.3 * jax.random.normal(jax.random.key(1), batch.old_logp.shape)
    batch = batch._replace(old_logp=sampler * batch.mask)
    cap, opt = 1.3, OptimizerConfig(learning_rate=1e-3, eps=1e-3)  # Adam's eps: see test_gradient_accumulation_...
    base = LossParams.from_config(GRPOConfig(grad_accum_steps=accum), 6, 1.0)
    fused = Learner(tr.graphdef, opt, dataclasses.replace(base, rescore_in_update=True, is_mode=mode, is_cap=cap), 10)
    apart = Learner(tr.graphdef, opt, base, 10)
    fresh = lambda lr: lr.init_state(jax.tree.map(jnp.copy, tr.params))
    s_in, m_in = fused.update(fresh(fused), batch)
    behaviour = apart.score_policy(tr.params, batch)
    w, metrics = algo.rollout_weights(behaviour, batch.old_logp, batch.mask, mode, cap)
    weighed = batch._replace(old_logp=behaviour, rollout_weight=None if mode is ISCorrection.OFF else w)
    s_apart, m_apart = apart.update(fresh(apart), weighed)
    assert set(metrics) <= set(m_in)
    assert ("rollout_is/frac_capped" in m_in) is (mode is not ISCorrection.OFF)
    for k in ("loss", "grad_norm", "kl", "entropy", "ratio_mean", *metrics):
        want = metrics[k] if k in metrics else m_apart[k]
        assert float(m_in[k]) == pytest.approx(float(want), rel=1e-4, abs=1e-6), k
    assert float(m_in["ratio_mean"]) == 1.0  # exactly on-policy: the update's own log-probs
    if mode is not ISCorrection.OFF:
        assert 0 < float(metrics["rollout_is/frac_capped"]) < 1  # the correction acted on some, not all
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), s_in["params"], s_apart["params"])


def test_mismatch_correction_is_on_where_the_learner_rescores():
    assert RolloutConfig().is_mode(DType.FLOAT32) is ISCorrection.OFF  # f32 built-in sampler: the same numbers
    assert RolloutConfig().is_mode(DType.BFLOAT16) is ISCorrection.TOKEN_TRUNCATE
    assert RolloutConfig(engine="http", server="sglang-jax").is_mode() is ISCorrection.TOKEN_TRUNCATE
    with pytest.raises(ConfigError, match=r"is_correction=sequence_mask weighs the rollout engine's log-probs"):
        RunConfig.from_dict({"train": {"rollout": {"is_correction": "sequence_mask"}}})
    # two iterations over the rollout: rescored in a pass of its own, before the first update
    rollout = {"recompute_logprobs": True, "is_correction": "token_mask", "is_cap": 1.5}
    tr, _ = make(steps=1, rollout=rollout, grpo={"num_iterations": 2})
    assert tr.rescore and not tr.rescore_in_update
    m = tr.train_step()
    assert m["time/rescore"] > 0
    assert m["rollout_is/weight_mean"] == pytest.approx(1.0, abs=1e-3)  # f32 sampler: ratios ~1, nothing masked
    assert m["rollout_is/frac_capped"] == 0.0 and m["rollout_is/mismatch_kl"] < 1e-6
