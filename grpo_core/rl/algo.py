"""The GRPO objective as small pure functions: advantages, the clipped surrogate, KL estimators,
loss aggregation and the per-token metrics. Each takes only the scalars it needs. Shapes: B
completions (rows of consecutive groups of G), N completion tokens.

These are the functions the learner (grpo_core.rl.learner) trains with, and the ones
tests/test_algo.py pins by hand: no second copy of a formula exists for the tests alone. The
entropy is the exception: the learner gets it from the chunked head (grpo_core.rl.logprobs),
which never holds the full logits; the plain formula over all logits is the tests' reference.

The group statistics (advantages, normalize_then_sum, zero_std_groups) take NumPy arrays as well
as JAX ones and answer in kind: the trainer computes them for a step's (B,) rewards on the host
in NumPy, where a JAX call would trace, compile and dispatch a program for a few dozen floats.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo_core.config.train import (
    AdvantageEstimator,
    ISCorrection,
    KLEstimator,
    LossAggregation,
    RatioLevel,
    RewardScaling,
)


def _xp(x):
    """The array module of `x`: NumPy for a NumPy array, else jax.numpy."""
    return np if isinstance(x, np.ndarray) else jnp


def _nan_mean(x, axis=None, keepdims=False):
    """Mean over the non-NaN entries, and their count (in x's dtype)."""
    xp = _xp(x)
    ok = ~xp.isnan(x)
    n = xp.sum(ok, axis=axis, keepdims=keepdims).astype(x.dtype)
    return xp.sum(xp.where(ok, x, 0.0), axis=axis, keepdims=keepdims) / xp.maximum(n, 1), n


def _nan_std(x, axis=None, keepdims=False):
    """Unbiased (n - 1) std over the non-NaN entries, as torch.std (and so TRL) computes it."""
    xp = _xp(x)
    mean, n = _nan_mean(x, axis=axis, keepdims=True)
    sq = xp.where(xp.isnan(x), 0.0, (x - mean) ** 2)
    total = xp.sum(sq, axis=axis, keepdims=keepdims)
    return xp.sqrt(total / xp.maximum(n.reshape(total.shape) - 1, 1))


def advantages(
    rewards: jax.Array, group_size: int, estimator: AdvantageEstimator, scale: RewardScaling, eps: float = 1e-4
) -> jax.Array:
    """(B,) rewards -> (B,) advantages. NaN rewards (excluded rows) get advantage 0 and do not
    count in their group's statistics.

    grpo:    (r - mean_g) / (std + eps)
    dr_grpo: r - mean_g
    rloo:    r - mean of the other members of the group = G/(G-1) * (r - mean_g)
    The std is the group's (scale=group), the whole batch's (scale=batch) or none.
    """
    xp = _xp(rewards)
    r = rewards.reshape(-1, group_size)  # (P, G)
    mean, n = _nan_mean(r, axis=1, keepdims=True)
    if estimator is AdvantageEstimator.RLOO:
        centered = (r - mean) * n / xp.maximum(n - 1, 1)
    else:
        centered = r - mean
    if scale is RewardScaling.GROUP:
        centered = centered / (_nan_std(r, axis=1, keepdims=True) + eps)
    elif scale is RewardScaling.BATCH:
        centered = centered / (_nan_std(rewards) + eps)
    return xp.where(xp.isnan(r), 0.0, centered).reshape(-1)


def zero_std_groups(rewards: jax.Array, group_size: int) -> jax.Array:
    """(B,) -> (P,) True for groups whose (non-excluded) rewards are all equal."""
    xp = _xp(rewards)
    r = rewards.reshape(-1, group_size)
    hi = xp.max(xp.where(xp.isnan(r), -xp.inf, r), axis=1)
    lo = xp.min(xp.where(xp.isnan(r), xp.inf, r), axis=1)
    return ~(hi > lo)


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: KLEstimator) -> jax.Array:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta."""
    x = ref_logp - logp
    if estimator is KLEstimator.K1:
        return -x
    if estimator is KLEstimator.K2:
        return 0.5 * x * x
    return jnp.exp(x) - x - 1.0


def log_ratio(logp: jax.Array, old_logp: jax.Array, mask: jax.Array, level: RatioLevel) -> jax.Array:
    """log(pi_theta / pi_old) per token, (B, N). GSPO's sequence level uses the length-normalised
    sequence log-ratio for every token of the sequence."""
    lr = logp - old_logp
    if level is RatioLevel.TOKEN:
        return lr
    seq = jnp.sum(lr * mask, axis=-1, keepdims=True) / jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1)
    return jnp.broadcast_to(seq, lr.shape)


def clipped_surrogate(
    log_r: jax.Array, adv: jax.Array, eps_low: float, eps_high: float, dual_clip: float | None = None
) -> jax.Array:
    """Per-token policy loss max(-A·rho, -A·clip(rho, 1-eps_low, 1+eps_high)), (B, N).

    adv is (B,) or (B, N). With dual-clip c, the loss of a negative-advantage token is capped
    at -c·A, so a huge ratio on a bad token cannot blow up the update.
    """
    a = adv[:, None] if adv.ndim == 1 else adv
    rho = jnp.exp(log_r)
    loss = jnp.maximum(-a * rho, -a * jnp.clip(rho, 1.0 - eps_low, 1.0 + eps_high))
    if dual_clip is not None:
        loss = jnp.where(a < 0, jnp.minimum(loss, -dual_clip * a), loss)
    return loss


def cispo_loss(logp: jax.Array, log_r: jax.Array, adv: jax.Array, cap: float) -> jax.Array:
    """CISPO's per-token loss -sg(min(rho, cap)) · A · log pi, (B, N): the importance weight is
    clipped (and carries no gradient); the log-prob's gradient never is."""
    a = adv[:, None] if adv.ndim == 1 else adv
    weight = jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_r), cap))
    return -weight * a * logp


def sapo_loss(log_r: jax.Array, adv: jax.Array, tau_pos: float, tau_neg: float) -> jax.Array:
    """SAPO's per-token loss -A · sigmoid(tau (rho - 1)) · 4 / tau, (B, N), tau_pos where A > 0 and
    tau_neg elsewhere: a soft gate in place of the clip, whose gradient at rho = 1 is the plain
    policy gradient's (-A) and fades smoothly as rho leaves 1."""
    a = adv[:, None] if adv.ndim == 1 else adv
    tau = jnp.where(a > 0, tau_pos, tau_neg)
    return -a * jax.nn.sigmoid(tau * (jnp.exp(log_r) - 1.0)) * 4.0 / tau


def high_entropy_mask(entropy: jax.Array, mask: jax.Array, quantile: float) -> jax.Array:
    """(B, N) 1.0 on the tokens whose entropy is at or above the (1 - quantile) quantile of the
    masked tokens' entropies, 0.0 elsewhere (TRL's top_entropy_quantile; 1.0 keeps every token)."""
    ent = jax.lax.stop_gradient(entropy)
    threshold = jnp.nanquantile(jnp.where(mask > 0, ent, jnp.nan), 1.0 - quantile)
    return ((ent >= threshold) & (mask > 0)).astype(mask.dtype)


def normalize_then_sum(per_function: jax.Array, weights: jax.Array, group_size: int, eps: float = 1e-4) -> jax.Array:
    """GDPO's advantages (TRL's multi_objective_aggregation=normalize_then_sum), (B, K) -> (B,):
    each reward normalised within its group ((r - mean) / (std + eps), NaN rows left out), the
    weighted sum over rewards, then that sum normalised over the batch. A row no reward scored
    gets 0."""
    xp = _xp(per_function)
    b, k = per_function.shape
    r = per_function.reshape(-1, group_size, k)  # (P, G, K)
    mean, _ = _nan_mean(r, axis=1, keepdims=True)
    z = (r - mean) / (_nan_std(r, axis=1, keepdims=True) + eps)
    scored = ~xp.all(xp.isnan(per_function), axis=1)
    total = xp.sum(xp.where(xp.isnan(z), 0.0, z * weights), axis=2).reshape(b)
    total = xp.where(scored, total, xp.nan)
    m, _ = _nan_mean(total)
    return xp.where(scored, (total - m) / (_nan_std(total) + eps), 0.0)


class MismatchSums(NamedTuple):
    """The sampler/learner log-prob mismatch of some rows, as sums over their masked tokens (the
    micro-batches of an update add up, `gap_max` takes their largest): mismatch_means turns an
    update batch's into the reported metrics."""

    gap: jax.Array  # |learner - sampler| (verl's rollout_probs_diff)
    gap_max: jax.Array
    kl: jax.Array  # k3 terms of KL(sampler || learner) on the sampled tokens
    weight: jax.Array  # the importance weights
    capped: jax.Array  # tokens (token_*) or sequences (sequence_*) capped or masked
    units: jax.Array  # tokens or sequences that `capped` counts among

    def add(self, other: "MismatchSums") -> "MismatchSums":
        both = zip(self._fields, self, other)
        return MismatchSums(*(jnp.maximum(a, b) if k == "gap_max" else a + b for k, a, b in both))

    @classmethod
    def zeros(cls) -> "MismatchSums":
        return cls(*(jnp.float32(0) for _ in cls._fields))


def rollout_mismatch(
    learner_logp: jax.Array, sampler_logp: jax.Array, mask: jax.Array, mode: ISCorrection, cap: float
) -> tuple[jax.Array, MismatchSums]:
    """The sampler/learner mismatch correction: (B, N) weights, and the mismatch's sums. w =
    pi_learner / pi_sampler of each token (token_*), or of the whole sequence, exp(sum of the
    token log ratios), for every token of it (sequence_*); *_truncate caps w at `cap`, *_mask
    zeroes it above (`off`: the uncapped token ratios, for the metrics alone). The sums: |log-prob
    difference|, the mismatch KL(sampler || learner) estimated on the sampled tokens (k3), the
    weights, and the tokens (token_*) or sequences (sequence_*) capped or masked."""
    log_w = (learner_logp - sampler_logp) * mask
    gap = jnp.abs(log_w)
    if mode in (ISCorrection.SEQUENCE_TRUNCATE, ISCorrection.SEQUENCE_MASK):
        seq = jnp.sum(log_w, axis=-1, keepdims=True)
        log_w = jnp.broadcast_to(seq, mask.shape)
        rows = jnp.any(mask > 0, axis=-1)
        units, capped = jnp.sum(rows), jnp.sum((seq[:, 0] > jnp.log(cap)) & rows)
    else:
        units, capped = jnp.sum(mask), jnp.sum((log_w > jnp.log(cap)) * mask)
    w = jnp.exp(jnp.minimum(log_w, 60.0))  # exp of a long sequence's sum stays finite before the cap
    if mode in (ISCorrection.TOKEN_TRUNCATE, ISCorrection.SEQUENCE_TRUNCATE):
        w = jnp.minimum(w, cap)
    elif mode in (ISCorrection.TOKEN_MASK, ISCorrection.SEQUENCE_MASK):
        w = jnp.where(w > cap, 0.0, w)
    x = sampler_logp - learner_logp  # k3 estimate of KL(sampler || learner) from the sampler's tokens
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    sums = MismatchSums(
        gap=f32(jnp.sum(gap)),
        gap_max=f32(jnp.max(gap)),
        kl=f32(jnp.sum((jnp.exp(x) - x - 1.0) * mask)),
        weight=f32(jnp.sum(w * mask)),
        capped=f32(capped),
        units=f32(units),
    )
    return w * mask, sums


def mismatch_means(sums: MismatchSums, mask: jax.Array, correction: bool) -> dict[str, jax.Array]:
    """The metrics of an update batch's mismatch sums: the log-prob gap (mean and max per token),
    and with a `correction` on, its KL, the fraction capped and the mean weight."""
    n = jnp.maximum(jnp.sum(mask), 1.0)
    out = {"logprobs/sampler_gap_mean": sums.gap / n, "logprobs/sampler_gap_max": sums.gap_max}
    if correction:
        out.update(
            {
                "rollout_is/mismatch_kl": sums.kl / n,
                "rollout_is/frac_capped": sums.capped / jnp.maximum(sums.units, 1.0),
                "rollout_is/weight_mean": sums.weight / n,
            }
        )
    return out


def rollout_weights(
    learner_logp: jax.Array, sampler_logp: jax.Array, mask: jax.Array, mode: ISCorrection, cap: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """rollout_mismatch's weights and metrics over a whole batch (the trainer's, where the learner
    rescores old_logp in a pass of its own): the log-prob gap, the mismatch KL, the fraction capped
    and the mean weight."""
    w, sums = rollout_mismatch(learner_logp, sampler_logp, mask, mode, cap)
    return w, mismatch_means(sums, mask, mode is not ISCorrection.OFF)


def clip_counts(log_r, adv, mask, eps_low, eps_high) -> tuple[jax.Array, jax.Array]:
    """Tokens whose ratio the clip stopped: (low with A<0, high with A>0). Counts, so that
    micro-batches add up; token_means divides them by the update batch's tokens."""
    a = adv[:, None] if adv.ndim == 1 else adv
    rho = jnp.exp(log_r)
    low = jnp.sum(((rho < 1 - eps_low) & (a < 0)) * mask)
    high = jnp.sum(((rho > 1 + eps_high) & (a > 0)) * mask)
    return low, high


class TokenSums(NamedTuple):
    """The per-token metrics of some rows, as sums over their masked tokens: micro-batches add
    up, and token_means turns the update batch's total into the reported means."""

    kl: jax.Array
    entropy: jax.Array
    clip_ratio_low: jax.Array  # tokens with A < 0 whose ratio the clip held at 1 - eps_low
    clip_ratio_high: jax.Array  # tokens with A > 0 whose ratio the clip held at 1 + eps_high
    ratio_mean: jax.Array  # pi_theta / pi_old


def token_sums(log_r, adv, kl, entropy, mask, eps_low, eps_high) -> TokenSums:
    """The metric sums of rows: log_r (B, N) as log_ratio gives it, adv (B,) or (B, N), kl and
    entropy (B, N) per token, mask (B, N)."""
    low, high = clip_counts(log_r, adv, mask, eps_low, eps_high)
    return TokenSums(
        kl=jnp.sum(kl * mask),
        entropy=jnp.sum(entropy * mask),
        clip_ratio_low=low,
        clip_ratio_high=high,
        ratio_mean=jnp.sum(jnp.exp(log_r) * mask),
    )


def token_means(sums: TokenSums, mask: jax.Array) -> TokenSums:
    """The sums over an update batch divided by its tokens (the means the trainer reports; the
    clip entries become the fractions of tokens clipped)."""
    n = jnp.maximum(jnp.sum(mask), 1.0)
    return jax.tree.map(lambda v: v / n, sums)


def token_weights(mask: jax.Array, mode: LossAggregation, num_micro: int, max_len: int) -> jax.Array:
    """(B, N) weights w so that the aggregated loss of an update batch is sum(w * per_token_loss).

    Expressing every aggregation as fixed weights computed over the whole update batch makes
    gradient accumulation exact: micro-batch losses are plain sums of their rows' terms.
    `num_micro` micro-batches split the rows evenly (BNPO normalises within each).
      token_mean              mask / tokens in the update batch           (DAPO)
      seq_mean_token_mean     mask / (len_i * B)                          (GRPO)
      seq_mean_token_sum_norm mask / (max_len * B)                        (Dr. GRPO)
      bnpo                    mask / (tokens in its micro-batch * num_micro)
    """
    mask = mask.astype(jnp.float32)
    b = mask.shape[0]
    if mode is LossAggregation.TOKEN_MEAN:
        return mask / jnp.maximum(jnp.sum(mask), 1.0)
    if mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        return mask / (jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0) * b)
    if mode is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM:
        return mask / (max_len * b)
    micro = mask.reshape(num_micro, b // num_micro, -1)
    per_micro = jnp.maximum(jnp.sum(micro, axis=(1, 2), keepdims=True), 1.0)
    return (micro / (per_micro * num_micro)).reshape(mask.shape)


def weighted_sum(per_token: jax.Array, weights: jax.Array) -> jax.Array:
    """The loss of some rows: sum(w * per_token), w their rows of token_weights. Over the
    whole update batch it is the aggregated loss; over a micro-batch, that micro-batch's share."""
    return jnp.sum(weights * per_token)
