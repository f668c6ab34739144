"""Pinned numbers for the GRPO math, each worked by hand in the comments. These are the
functions the learner trains with (grpo_core.rl.learner._loss and update); the entropy it reports
comes from the chunked head, pinned against the plain formula in tests/test_logprobs.py and here
on a uniform distribution."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_core.config.run import RunConfig
from grpo_core.config.train import (
    AdvantageEstimator as Adv,
)
from grpo_core.config.train import (
    KLEstimator,
    RatioLevel,
)
from grpo_core.config.train import (
    LossAggregation as Agg,
)
from grpo_core.config.train import (
    RewardScaling as Scale,
)
from grpo_core.errors import ConfigError
from grpo_core.rl import algo
from grpo_core.rl.logprobs import token_logprobs

EPS = 1e-4
# Two groups of G=4. Group 0: mean 1, deviations (1, -1, 0, 0), unbiased var 2/3. Group 1: all 3.
REWARDS = jnp.array([2.0, 0.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0])


def test_grpo_advantages_group_std():
    s = math.sqrt(2 / 3) + EPS
    want = [1 / s, -1 / s, 0, 0, 0, 0, 0, 0]  # zero-variance group: 0 / (0 + eps) = 0
    np.testing.assert_allclose(algo.advantages(REWARDS, 4, Adv.GRPO, Scale.GROUP, EPS), want, rtol=1e-6)


def test_grpo_advantages_batch_std():
    # Batch: mean 2, deviations (0,-2,-1,-1,1,1,1,1), sum of squares 10, unbiased var 10/7.
    s = math.sqrt(10 / 7) + EPS
    want = [1 / s, -1 / s, 0, 0, 0, 0, 0, 0]
    np.testing.assert_allclose(algo.advantages(REWARDS, 4, Adv.GRPO, Scale.BATCH, EPS), want, rtol=1e-6)


def test_dr_grpo_advantages_no_std():
    np.testing.assert_allclose(
        algo.advantages(REWARDS, 4, Adv.DR_GRPO, Scale.NONE), [1, -1, 0, 0, 0, 0, 0, 0], atol=1e-7
    )


def test_rloo_advantages_leave_one_out():
    # 2 - (0+1+1)/3 = 4/3; 0 - (2+1+1)/3 = -4/3; 1 - (2+0+1)/3 = 0.
    want = [4 / 3, -4 / 3, 0, 0, 0, 0, 0, 0]
    np.testing.assert_allclose(algo.advantages(REWARDS, 4, Adv.RLOO, Scale.NONE), want, rtol=1e-6, atol=1e-7)


def test_rloo_scaled_by_a_std_is_refused():
    """Divided by the group's std, RLOO is G/(G-1) x the GRPO advantage (4/3 at G=4): the config
    refuses it rather than train GRPO under RLOO's name."""
    grpo = np.asarray(algo.advantages(REWARDS, 4, Adv.GRPO, Scale.GROUP))
    scaled = np.asarray(algo.advantages(REWARDS, 4, Adv.RLOO, Scale.GROUP))
    np.testing.assert_allclose(scaled[:2], grpo[:2] * 4 / 3, rtol=1e-5)
    with pytest.raises(ConfigError, match=r"grpo.advantage=rloo .* set grpo.scale_rewards=none \(got group"):
        RunConfig.from_dict({"train": {"grpo": {"advantage": "rloo"}}})
    cfg = RunConfig.from_dict({"train": {"grpo": {"advantage": "rloo", "scale_rewards": "none"}}})
    assert cfg.train.grpo.advantage is Adv.RLOO


def test_excluded_rows_do_not_count():
    # Group (1, None, 0, 1): mean 2/3 over 3 rows; deviations (1/3, -2/3, 1/3), var (6/9)/2 = 1/3.
    r = jnp.array([1.0, jnp.nan, 0.0, 1.0])
    s = math.sqrt(1 / 3) + EPS
    want = [(1 / 3) / s, 0.0, (-2 / 3) / s, (1 / 3) / s]
    np.testing.assert_allclose(algo.advantages(r, 4, Adv.GRPO, Scale.GROUP, EPS), want, rtol=1e-5)
    assert list(np.asarray(algo.zero_std_groups(jnp.array([1.0, jnp.nan, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]), 4))) == [
        True,
        False,
    ]


def test_group_statistics_in_numpy_are_the_jax_ones():
    """The trainer computes a step's group statistics on the host in NumPy: each function answers a
    NumPy array in kind (no device program) with JAX's float32 numbers, NaN rows included."""
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=24).astype(np.float32)
    rewards[[3, 10, 11]] = np.nan
    rewards[16:20] = 1.0  # a group whose rewards are all equal
    per = rng.normal(size=(24, 3)).astype(np.float32)
    per[5] = np.nan  # a row no reward scored
    per[7, 1] = np.nan
    weights = np.asarray([1.0, 0.5, 2.0], np.float32)
    j = jnp.asarray
    cases = [(algo.advantages, (rewards, 4, a, sc, EPS), (j(rewards), 4, a, sc, EPS)) for a in Adv for sc in Scale]
    cases += [
        (algo.zero_std_groups, (rewards, 4), (j(rewards), 4)),
        (algo.normalize_then_sum, (per, weights, 4, EPS), (j(per), j(weights), 4, EPS)),
    ]
    for fn, np_args, jax_args in cases:
        got, want = fn(*np_args), np.asarray(fn(*jax_args))
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype, (fn.__name__, np_args[1:])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{fn.__name__} {np_args[1:]}")


# Four rows of three tokens; micro-batches of two rows each for BNPO.
LOSS = jnp.array([[1.0, 2, 3], [4, 5, 6], [1, 1, 1], [2, 2, 2]])
MASK = jnp.array([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, micro, want",
    [
        (Agg.TOKEN_MEAN, 1, 12 / 7),  # (1+2 + 4 + 1+1+1 + 2) / 7 tokens
        (Agg.SEQ_MEAN_TOKEN_MEAN, 1, (1.5 + 4 + 1 + 2) / 4),  # mean of per-row token means
        (Agg.SEQ_MEAN_TOKEN_SUM_NORM, 1, (3 + 4 + 3 + 2) / (3 * 4)),  # token sums / (max_len 3 * 4 rows)
        (Agg.BNPO, 2, (7 / 3 + 5 / 4) / 2),  # micro-batch token means: 7/3 and 5/4, averaged
        (Agg.BNPO, 1, 12 / 7),  # one micro-batch: the token mean
    ],
)
def test_loss_aggregation(mode, micro, want):
    # the update's loss: the weights of the whole update batch, summed against the per-token loss
    got = algo.weighted_sum(LOSS, algo.token_weights(MASK, mode, num_micro=micro, max_len=3))
    assert float(got) == pytest.approx(want, rel=1e-6)


def test_token_weights_make_accumulation_exact():
    # The sum of per-micro-batch weighted losses (what the learner accumulates) equals the whole
    # batch's aggregated loss.
    for mode in (Agg.TOKEN_MEAN, Agg.SEQ_MEAN_TOKEN_MEAN, Agg.SEQ_MEAN_TOKEN_SUM_NORM):
        w = algo.token_weights(MASK, mode, 2, 3)
        parts = float(algo.weighted_sum(LOSS[:2], w[:2]) + algo.weighted_sum(LOSS[2:], w[2:]))
        whole = algo.weighted_sum(LOSS, algo.token_weights(MASK, mode, 1, 3))
        assert parts == pytest.approx(float(whole), rel=1e-6)


@pytest.mark.parametrize(
    "est, want",
    [
        # x = log ref - log pi = log(0.25) - log(0.5) = -ln 2
        (KLEstimator.K1, math.log(2)),  # -x
        (KLEstimator.K2, 0.5 * math.log(2) ** 2),  # x^2 / 2
        (KLEstimator.K3, 0.5 + math.log(2) - 1),  # e^x - x - 1 = 1/2 + ln 2 - 1
    ],
)
def test_kl_estimators(est, want):
    got = algo.kl_penalty(jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25])), est)
    assert float(got[0]) == pytest.approx(want, rel=1e-6)


def test_kl_is_zero_at_the_reference():
    lp = jnp.log(jnp.array([0.1, 0.7]))
    for est in KLEstimator:
        np.testing.assert_allclose(algo.kl_penalty(lp, lp, est), 0.0, atol=1e-7)


@pytest.mark.parametrize(
    "rho, adv, eps_high, dual, want",
    [
        (1.5, 1.0, 0.2, None, -1.2),  # max(-1.5, -1.2): clipped at 1 + eps_high
        (1.5, 1.0, 0.28, None, -1.28),  # DAPO clip-higher
        (0.5, 1.0, 0.2, None, -0.5),  # max(-0.5, -0.8): the unclipped term is pessimistic
        (0.5, -1.0, 0.2, None, 0.8),  # max(0.5, 0.8): clipped at 1 - eps_low
        (1.5, -1.0, 0.2, None, 1.5),  # max(1.5, 1.2)
        (4.0, -1.0, 0.2, 3.0, 3.0),  # dual-clip caps -A*rho = 4 at -c*A = 3
        (1.5, -1.0, 0.2, 3.0, 1.5),  # below the cap: unchanged
        (4.0, 1.0, 0.2, 3.0, -1.2),  # dual-clip only touches negative advantages
    ],
)
def test_clipped_surrogate(rho, adv, eps_high, dual, want):
    got = algo.clipped_surrogate(jnp.log(jnp.array([[rho]])), jnp.array([adv]), 0.2, eps_high, dual)
    assert float(got[0, 0]) == pytest.approx(want, rel=1e-6)


def test_gspo_sequence_ratio_is_masked_mean():
    logp = jnp.array([[0.1, 0.3, 9.0]])
    old = jnp.zeros((1, 3))
    mask = jnp.array([[1.0, 1.0, 0.0]])
    np.testing.assert_allclose(algo.log_ratio(logp, old, mask, RatioLevel.SEQUENCE), [[0.2, 0.2, 0.2]], rtol=1e-6)
    np.testing.assert_allclose(algo.log_ratio(logp, old, mask, RatioLevel.TOKEN), logp)


def test_clip_fractions():
    # ratios (0.5, 1.5, 1.0, 1.5) with advantages (-1, 1, 1, -1) and eps 0.2: token 0 is clipped
    # low (0.5 < 0.8, A < 0), token 1 high (1.5 > 1.2, A > 0), token 3 is not (A < 0 clips low only).
    log_r = jnp.log(jnp.array([[0.5, 1.5, 1.0, 1.5]]))
    adv = jnp.array([[-1.0, 1.0, 1.0, -1.0]])
    zeros = jnp.zeros((1, 4))
    m = algo.token_means(algo.token_sums(log_r, adv, zeros, zeros, jnp.ones((1, 4)), 0.2, 0.2), jnp.ones((1, 4)))
    assert (float(m.clip_ratio_low), float(m.clip_ratio_high)) == (0.25, 0.25)


def test_token_metrics_sum_over_micro_batches_and_divide_by_the_update_batch():
    # Two rows, mask (1, 1, 0) and (1, 0, 0): 3 tokens. Per row (B,) advantages, as the learner's.
    log_r = jnp.log(jnp.array([[0.5, 1.0, 9.0], [1.5, 9.0, 9.0]]))
    adv = jnp.array([-1.0, 1.0])
    kl = jnp.array([[0.1, 0.2, 5.0], [0.3, 5.0, 5.0]])
    ent = jnp.array([[1.0, 2.0, 7.0], [3.0, 7.0, 7.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    whole = algo.token_sums(log_r, adv, kl, ent, mask, 0.2, 0.2)
    # kl 0.1+0.2+0.3, entropy 1+2+3, ratio 0.5+1+1.5; clipped: row 0 token 0 low, row 1 token 0 high
    np.testing.assert_allclose(whole, [0.6, 6.0, 1.0, 1.0, 3.0], rtol=1e-6)
    rows = [
        algo.token_sums(log_r[i : i + 1], adv[i : i + 1], kl[i : i + 1], ent[i : i + 1], mask[i : i + 1], 0.2, 0.2)
        for i in range(2)
    ]
    np.testing.assert_allclose(jnp.add(*[jnp.stack(r) for r in rows]), whole, rtol=1e-6)
    means = algo.token_means(whole, mask)
    np.testing.assert_allclose(means, [0.2, 2.0, 1 / 3, 1 / 3, 1.0], rtol=1e-6)
    assert means._fields == ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "ratio_mean")


def test_entropy_of_uniform_is_log_v():
    # The learner's entropy (grpo_core.rl.logprobs, in vocabulary chunks): zero hidden states give
    # equal logits over all 7 words, entropy ln 7 and log-prob -ln 7 for any target.
    h, w = jnp.zeros((1, 2, 4)), jnp.ones((7, 4))
    logp, ent = token_logprobs(h, w, jnp.array([[0, 6]]), chunk_mib=2 * 7 * 4 / 3 / 2**20, vocab_major=True)
    np.testing.assert_allclose(ent, math.log(7), rtol=1e-6)
    np.testing.assert_allclose(logp, -math.log(7), rtol=1e-6)
