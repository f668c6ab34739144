"""The jitted half of training: log-probs of completions, the GRPO loss and one update
`(state, batch) -> (state, metrics)` (Learner.update) with donated state and gradient
accumulation inside. The loss and its metrics are grpo_core.rl.algo's functions, the ones its
tests pin.

A training batch (grpo_core.rl.types.Batch) holds each prompt once (P rows, left-padded to Tp)
and its G completions (B = P*G rows of N tokens). The model runs the prompt once per group and
the completions against it (CausalLM.hidden_states_grouped): with short prompts and G = 8 that
is a quarter less compute than scoring B full rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from grpo_core.config.model import DType
from grpo_core.config.train import (
    GRPOConfig,
    ISCorrection,
    KLEstimator,
    LossAggregation,
    OptimizerConfig,
    PolicyLoss,
    RatioLevel,
    RematPolicy,
    TrainConfig,
)
from grpo_core.generate.sampler import spec_of
from grpo_core.nn.model import CausalLM
from grpo_core.rl import algo
from grpo_core.rl.logprobs import DEFAULT_CHUNK_MIB, token_logprobs
from grpo_core.rl.types import Batch, TrainState


@dataclasses.dataclass(frozen=True)
class LossParams:
    """The static scalars of the loss (hashable: part of the compiled program's identity)."""

    epsilon_low: float
    epsilon_high: float
    dual_clip: float | None
    beta: float
    kl_estimator: KLEstimator
    ratio_level: RatioLevel
    aggregation: LossAggregation
    grad_accum_steps: int
    max_new_tokens: int
    temperature: float
    remat: RematPolicy = RematPolicy.NONE
    chunk_mib: int = DEFAULT_CHUNK_MIB  # one vocabulary chunk's f32 logits (grpo_core.rl.logprobs)
    policy_loss: PolicyLoss = PolicyLoss.CLIP
    sapo_tau: tuple[float, float] = (1.0, 1.05)  # (A > 0, A <= 0)
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0
    # old_logp rescored in the update's own forward (TrainConfig.rescores_in_update): the batch's
    # old_logp is then the sampler's, weighed by the mismatch correction is_mode at is_cap
    rescore_in_update: bool = False
    is_mode: ISCorrection = ISCorrection.OFF
    is_cap: float = 2.0
    backend: str = "cpu"  # the platform compiled for, which rounds the chunk count (set by the Learner)
    mesh: Mesh | None = None  # the learner's mesh, when it has more than one device: activations laid out over its rows

    @classmethod
    def from_config(
        cls,
        g: GRPOConfig,
        max_new_tokens: int,
        temperature: float,
        remat: RematPolicy = RematPolicy.NONE,
        chunk_mib: int = DEFAULT_CHUNK_MIB,
        rescore: tuple[ISCorrection, float] | None = None,
    ) -> "LossParams":
        """`rescore`: (the mismatch correction, its cap) where old_logp is rescored in the update, else None."""
        if g.grad_accum_steps == "auto" or remat is RematPolicy.AUTO:
            raise ValueError(
                "grad_accum_steps and remat must be chosen before the learner is built "
                "(grpo_core.config.memory.plan resolves auto)"
            )
        return cls(  # by name: a field added anywhere cannot shift the others
            epsilon_low=g.epsilon_low,
            epsilon_high=g.epsilon_high,
            dual_clip=g.dual_clip,
            beta=g.beta,
            kl_estimator=g.kl_estimator,
            ratio_level=g.ratio_level,
            aggregation=g.loss_aggregation,
            grad_accum_steps=g.grad_accum_steps,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            remat=remat,
            chunk_mib=chunk_mib,
            policy_loss=g.policy_loss,
            sapo_tau=(g.sapo_temperature_pos, g.sapo_temperature_neg),
            entropy_coef=g.entropy_coef,
            top_entropy_quantile=g.top_entropy_quantile,
            rescore_in_update=rescore is not None,
            is_mode=ISCorrection.OFF if rescore is None else rescore[0],
            is_cap=2.0 if rescore is None else rescore[1],
        )

    @classmethod
    def from_train(cls, t: TrainConfig, compute_dtype: DType = DType.FLOAT32) -> "LossParams":
        """The loss of `t` for a policy computing in `compute_dtype` (which decides where old_logp comes from)."""
        r = t.rollout
        rescore = (r.is_mode(compute_dtype), r.is_cap) if t.rescores_in_update(compute_dtype) else None
        return cls.from_config(
            t.grpo, t.completion_tokens, t.sampling.temperature, t.remat, t.logits_chunk_mib, rescore
        )


def completion_logprobs(
    model: CausalLM,
    prompt_tokens,
    prompt_valid,
    targets,
    temperature: float,
    *,
    remat: RematPolicy = RematPolicy.NONE,
    chunk_mib: int = DEFAULT_CHUNK_MIB,
    head_grad: bool = True,
    backend: str = "cpu",
    mesh=None,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of each completion token under softmax(logits / T), and the entropy there:
    (B, N) each. No (B, N, V) tensor is made (grpo_core.rl.logprobs); `head_grad=False` when the LM
    head is frozen (LoRA), so its gradient is not computed. `mesh`: the devices' mesh, over whose
    rows the trunk lays out its activations (CausalLM.hidden_states_grouped)."""
    h = model.hidden_states_grouped(prompt_tokens, prompt_valid, targets[:, :-1], remat, mesh)  # (B, N, E)
    w, vocab_major = model.head()
    return token_logprobs(
        h,
        w,
        targets,
        temperature=temperature,
        chunk_mib=chunk_mib,
        vocab_major=vocab_major,
        dtype=jnp.float32 if model.config.dtype is DType.FLOAT32 else jnp.bfloat16,
        w_grad=head_grad,
        backend=backend,
    )


def make_optimizer(cfg: OptimizerConfig, total_updates: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup then cosine decay to min_lr_ratio; clipping by global norm first."""
    decay = cfg.decay_steps if cfg.decay_steps is not None else max(total_updates - cfg.warmup_steps, 1)
    peak = cfg.learning_rate
    parts, bounds = [], []
    if cfg.warmup_steps:
        parts.append(optax.linear_schedule(0.0, peak, cfg.warmup_steps))
        bounds.append(cfg.warmup_steps)
    parts.append(
        optax.cosine_decay_schedule(peak, decay, alpha=cfg.min_lr_ratio) if decay else optax.constant_schedule(peak)
    )
    schedule = optax.join_schedules(parts, bounds) if bounds else parts[0]
    # Decay matrices only: norms and biases are left alone, as in the HF trainers.
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    mu_dtype = None if cfg.mu_dtype is None else jnp.dtype(cfg.mu_dtype.value)
    adamw = optax.adamw(
        schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask, mu_dtype=mu_dtype
    )
    tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw) if cfg.max_grad_norm else adamw
    return tx, schedule


def _loss(params, graphdef, micro: Batch, weights, hp: LossParams, frozen=None):
    """Sum of weighted per-token losses of one micro-batch, and its metric sums (algo.TokenSums).
    With LoRA `params` are the adapters and `frozen` the base weights, which get no gradient."""
    model = nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, frozen, params)
    logp, ent = completion_logprobs(
        model,
        micro.prompt_tokens,
        micro.prompt_valid,
        micro.targets,
        hp.temperature,
        remat=hp.remat,
        chunk_mib=hp.chunk_mib,
        head_grad=frozen is None,
        backend=hp.backend,
        mesh=hp.mesh,
    )
    mismatch, is_weights = None, micro.rollout_weight
    if hp.rescore_in_update:  # old_logp is this pass's own, held constant; the batch's, the sampler's
        old_logp = jax.lax.stop_gradient(logp)
        w, mismatch = algo.rollout_mismatch(old_logp, micro.old_logp, micro.mask, hp.is_mode, hp.is_cap)
        is_weights = None if hp.is_mode is ISCorrection.OFF else w  # of constants: no gradient
    else:
        old_logp = micro.old_logp
    log_r = algo.log_ratio(logp, old_logp, micro.mask, hp.ratio_level)
    if hp.policy_loss is PolicyLoss.CISPO:
        per_token = algo.cispo_loss(logp, log_r, micro.advantages, hp.epsilon_high)
    elif hp.policy_loss is PolicyLoss.SAPO:
        per_token = algo.sapo_loss(log_r, micro.advantages, *hp.sapo_tau)
    else:
        per_token = algo.clipped_surrogate(log_r, micro.advantages, hp.epsilon_low, hp.epsilon_high, hp.dual_clip)
    if is_weights is not None:  # the sampler/learner mismatch correction (train.rollout.is_correction)
        per_token = per_token * is_weights
    if hp.top_entropy_quantile < 1.0:  # the policy loss on the high-entropy "forking" tokens only (TRL)
        per_token = per_token * algo.high_entropy_mask(ent, micro.mask, hp.top_entropy_quantile)
    kl = algo.kl_penalty(logp, micro.ref_logp, hp.kl_estimator) if hp.beta > 0 else jnp.zeros_like(logp)
    per_token = per_token + hp.beta * kl
    if hp.entropy_coef > 0:  # verl's entropy bonus, aggregated as the loss is
        per_token = per_token - hp.entropy_coef * ent
    loss = algo.weighted_sum(per_token, weights)
    # token sums; divided by the update batch's token count after accumulation
    sums = algo.token_sums(log_r, micro.advantages, kl, ent, micro.mask, hp.epsilon_low, hp.epsilon_high)
    return loss, jax.tree.map(jax.lax.stop_gradient, (sums, mismatch))


def accumulator_dtype(dtype):
    """Gradients summed over micro-batches in at least f32: 16-bit sums lose the small terms."""
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4 else dtype


def update(state: TrainState, batch: Batch, frozen=None, *, graphdef, tx, schedule, hp: LossParams):
    """One optimizer update over `batch`, split into hp.grad_accum_steps micro-batches of whole
    groups (prompt arrays split P/A ways, completion arrays B/A ways: rows stay with their prompt).
    `frozen`: the base weights under LoRA (state["params"] then holds the adapters), else None."""
    a = hp.grad_accum_steps
    weights = algo.token_weights(batch.mask, hp.aggregation, a, hp.max_new_tokens)
    micro = jax.tree.map(lambda x: x.reshape(a, x.shape[0] // a, *x.shape[1:]), (batch, weights))
    grad_fn = jax.value_and_grad(_loss, has_aux=True)

    def accumulate(carry, mb):
        grads, loss, (sums, mismatch) = carry
        mb_batch, mb_weights = mb
        (mb_loss, (s, m)), g = grad_fn(state["params"], graphdef, mb_batch, mb_weights, hp, frozen)
        grads = jax.tree.map(lambda acc, x: acc + x.astype(acc.dtype), grads, g)
        mismatch = None if m is None else mismatch.add(m)
        return (grads, loss + mb_loss, (jax.tree.map(jnp.add, sums, s), mismatch)), None

    zero_sums = (
        algo.TokenSums(**{k: jnp.float32(0) for k in algo.TokenSums._fields}),
        algo.MismatchSums.zeros() if hp.rescore_in_update else None,
    )
    if a == 1:  # no loop: lets XLA fuse the whole step
        init = (jax.tree.map(jnp.zeros_like, state["params"]), jnp.float32(0), zero_sums)
        (grads, loss, sums), _ = accumulate(init, jax.tree.map(lambda x: x[0], micro))
    else:  # the sum over micro-batches in f32 (bf16 parameters' gradients round once, at the end)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, accumulator_dtype(p.dtype)), state["params"])
        init = (zeros, jnp.float32(0), zero_sums)
        (grads, loss, sums), _ = jax.lax.scan(accumulate, init, micro)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    sums, mismatch = sums
    metrics = algo.token_means(sums, batch.mask)._asdict()
    if mismatch is not None:  # old_logp rescored here: the sampler's gap (and its correction's metrics)
        metrics.update(algo.mismatch_means(mismatch, batch.mask, hp.is_mode is not ISCorrection.OFF))
    metrics.update(loss=loss, grad_norm=optax.tree.norm(grads), learning_rate=schedule(state["step"]))
    return TrainState(params=params, opt_state=opt_state, step=state["step"] + 1), metrics


def score_completions(
    graphdef,
    params,
    batch: Batch,
    temperature: float,
    chunk_mib: int = DEFAULT_CHUNK_MIB,
    backend: str = "cpu",
    mesh=None,
):
    """Log-probs of the completions under `params` (the reference policy, or the old policy).
    Forward only: every layer's activations die with it, so no rematerialisation applies.
    Reads the batch's prompt_tokens, prompt_valid and targets; a mapping of those three is taken
    too (grpo_core.stages.engine_selftest scores sampled tokens without a whole Batch)."""
    model = nnx.merge(graphdef, params)
    if isinstance(batch, Mapping):
        ptok, pval, targets = batch["prompt_tokens"], batch["prompt_valid"], batch["targets"]
    else:
        ptok, pval, targets = batch.prompt_tokens, batch.prompt_valid, batch.targets
    logp, _ = completion_logprobs(
        model, ptok, pval, targets, temperature, chunk_mib=chunk_mib, backend=backend, mesh=mesh
    )
    return logp


class Learner:
    """Holds the compiled update and scoring functions for one model graph and config."""

    def __init__(
        self, graphdef, opt_cfg: OptimizerConfig, hp: LossParams, total_updates: int, ref_graphdef=None, placement=None
    ):
        """`ref_graphdef`: the reference's graph when it differs from the policy's (LoRA: the base
        without adapters, scored on the base weights alone). `placement` (grpo_core.runtime.mesh): the
        meshes; the state lives on the learner's, the reference on its own. The programs are
        compiled for the platform of the placement's devices (this host's default without one)."""
        platform = jax.default_backend() if placement is None else placement.train.devices.flat[0].platform
        spread = lambda mesh: mesh if mesh is not None and mesh.size > 1 else None
        hp = dataclasses.replace(hp, backend=platform, mesh=None if placement is None else spread(placement.train))
        self.graphdef, self.hp, self.placement = graphdef, hp, placement
        self.tx, self.schedule = make_optimizer(opt_cfg, total_updates)
        self.state_sharding = None  # set by init_state; read when the update is traced

        def update_on_mesh(state: TrainState, batch: Batch, frozen=None):
            new, metrics = update(state, batch, frozen, graphdef=graphdef, tx=self.tx, schedule=self.schedule, hp=hp)
            if self.state_sharding is not None:  # the new state where the old one was: donation reuses its buffers
                new = jax.lax.with_sharding_constraint(new, self.state_sharding)
            return new, metrics

        # (state, batch, frozen=None) -> (state, metrics): one optimizer update. The state is
        # donated; never the frozen base: it lives on.
        self.update = jax.jit(update_on_mesh, donate_argnums=(0,))
        ref = graphdef if ref_graphdef is None else ref_graphdef
        score = lambda graph, mesh: jax.jit(
            lambda params, batch: score_completions(
                graph, params, batch, hp.temperature, hp.chunk_mib, hp.backend, spread(mesh)
            )
        )
        self._score = score(ref, None if placement is None else placement.reference)
        self.score_policy = score(graphdef, hp.mesh)  # the policy itself (adapters included): old_logp rescored

    def _ref_mesh(self):
        pl = self.placement
        return None if pl is None or pl.reference is pl.train else pl.reference

    def score(self, params, batch: Batch) -> jax.Array:
        """Log-probs of the batch's completions under `params` (the reference policy); on the
        reference's own mesh when it has one, the batch moved there and the result back."""
        mesh = self._ref_mesh()
        if mesh is None:
            return self._score(params, batch)
        return self.placement.put_batch(self._score(params, self.placement.put_batch(batch, mesh)))

    def compile_jobs(
        self, state: TrainState, batch_spec: Batch, minibatches: int, with_reference: bool, frozen=None, ref_params=None
    ):
        """Callables that compile the update (for minibatches of the batch) and the scorer
        (of `ref_params`, by default parameters shaped like the state's), for the layouts the
        arrays will have, so that the calls find these programs in the cache."""

        def batch_of(shape, dtype, mesh=None):
            sharding = None if self.placement is None else self.placement.batch_sharding(shape, mesh)
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        state_spec = spec_of(state)
        mb_spec = jax.tree.map(lambda s: batch_of((s.shape[0] // minibatches, *s.shape[1:]), s.dtype), batch_spec)
        jobs = [lambda: self.update.lower(state_spec, mb_spec, spec_of(frozen)).compile()]
        if with_reference:
            ref_spec = state_spec["params"] if ref_params is None else spec_of(ref_params)
            ref_batch = jax.tree.map(lambda s: batch_of(s.shape, s.dtype, self._ref_mesh()), batch_spec)
            jobs.append(lambda: self._score.lower(ref_spec, ref_batch).compile())
        return jobs

    def init_state(self, params) -> TrainState:
        """The train state of `params`: with a placement, the parameters and every optimizer
        moment laid out over the learner's mesh (runtime.mesh.partition_axes), the count replicated.
        Parameters given as shapes (jax.ShapeDtypeStruct) give a state of shapes, each with the
        sharding its array would have: what a checkpoint restores into, nothing computed."""
        if is_shapes(params):
            return self._state_shapes(params)
        if self.placement is None:
            return TrainState(params=params, opt_state=self.tx.init(params), step=jnp.int32(0))
        pl = self.placement
        params = pl.put_params(params)
        state = TrainState(
            params=params, opt_state=pl.init_opt_state(self.tx, params), step=pl.put_replicated(np.int32(0))
        )
        self.state_sharding = jax.tree.map(lambda x: x.sharding, state)
        return state

    def _state_shapes(self, params) -> TrainState:
        pl = self.placement
        if pl is None:
            raise ValueError("a train state of shapes needs the learner's placement: where its arrays will live")
        params = pl.put_params(params)
        state = TrainState(
            params=params,
            opt_state=pl.put_params(jax.eval_shape(self.tx.init, params)),  # each moment laid out as its parameter
            step=pl.put_replicated(jax.ShapeDtypeStruct((), jnp.int32)),
        )
        self.state_sharding = jax.tree.map(lambda x: x.sharding, state)
        return state


def is_shapes(tree) -> bool:
    """Whether `tree` holds shapes (jax.ShapeDtypeStruct) rather than arrays."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))
