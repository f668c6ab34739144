"""The engine's configuration: the model's architecture and everything training needs, one
section per concern. Fields are declared with grpo_core.config.fields.field (type, default,
description, bounds); each section's `validate` holds only the rules that relate fields.
"""

from __future__ import annotations

import enum
import math
import typing
from typing import Any

from grpo_core.config.agent import AgentConfig
from grpo_core.config.fields import Section, Trust, check, field, section
from grpo_core.config.model import DType

# ----------------------------------------------------------------------------------------------
# Sampling


# fmt: off
PROMPT_BUCKETS = (4, 8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024,
                  1280, 1536, 2048, 2560, 3072, 4096)
# fmt: on


@section(path="train.sampling")
class SamplingConfig(Section):
    """How completions are drawn. temperature 0 means greedy."""

    max_new_tokens: int = field(32, doc="Longest completion", ge=1, api_max=32_768)
    temperature: float = field(1.0, doc="Sampling temperature (0: greedy, refused for training)", ge=0)
    # 0 = off
    top_k: int = field(0, doc="Top-k (0: off)", ge=0)
    # 1.0 = off
    top_p: float = field(1.0, doc="Top-p (1: off)", gt=0, le=1)
    # Prompts are left-padded to the smallest bucket that holds them: one compiled program per
    # bucket, and at most ~25% padding instead of padding everything to the longest prompt.
    prompt_buckets: tuple[int, ...] = field(
        PROMPT_BUCKETS,
        doc="Prompt lengths to pad to (one compiled program each)",
        min_length=1,
    )
    # benchmarks force every completion to max_new_tokens
    ignore_eos: bool = field(False, doc="Always generate max_new_tokens (benchmarks)")

    def validate(self) -> None:
        b = tuple(self.prompt_buckets)
        check(
            len(b) > 0 and all(isinstance(x, int) and x > 0 for x in b) and list(b) == sorted(set(b)),
            f"sampling.prompt_buckets must be increasing positive integers, got {b}",
        )
        object.__setattr__(self, "prompt_buckets", b)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# ----------------------------------------------------------------------------------------------
# Algorithm


class AdvantageEstimator(enum.Enum):
    GRPO = "grpo"  # (r - mean_group) / (std + eps)
    DR_GRPO = "dr_grpo"  # r - mean_group: no std (Dr. GRPO)
    RLOO = "rloo"  # r - mean of the other G-1 completions of the group


class RewardScaling(enum.Enum):
    GROUP = "group"  # divide by the std of the group
    BATCH = "batch"  # divide by the std of the whole batch
    NONE = "none"


class LossAggregation(enum.Enum):
    TOKEN_MEAN = "token_mean"  # DAPO: sum over all tokens / tokens in the whole update batch
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"  # GRPO: mean over sequences of each one's token mean
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"  # Dr. GRPO: token sums / max_new_tokens
    BNPO = "bnpo"  # token mean within each micro-batch, averaged over micro-batches


class KLEstimator(enum.Enum):
    K1 = "k1"  # log pi - log ref
    K2 = "k2"  # (log pi - log ref)^2 / 2
    K3 = "k3"  # exp(x) - x - 1, x = log ref - log pi


class RematPolicy(enum.Enum):
    """What each decoder layer keeps for the backward pass (grpo_core.nn.model); the rest is
    recomputed there. AUTO: the fastest that fits the devices (grpo_core.config.memory chooses)."""

    AUTO = "auto"
    NONE = "none"  # keep every intermediate: fastest, most memory
    DOTS = "dots"  # keep the weight matmuls' outputs, recompute norms, RoPE, attention and activations
    FULL = "full"  # keep each layer's input only: about one more forward pass of compute


class PolicyLoss(enum.Enum):
    """The per-token policy loss (verl's policy_loss.loss_mode, TRL's loss_type beyond aggregation)."""

    CLIP = "clip"  # PPO/GRPO: max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))
    CISPO = "cispo"  # -stop_grad(min(rho, epsilon_high)) A log pi: the IS weight clipped, never the gradient
    SAPO = "sapo"  # -A sigmoid(tau (rho - 1)) 4 / tau: a soft gate for the clip (tau_pos / tau_neg by sign of A)


class RewardAggregation(enum.Enum):
    """How several reward functions make one advantage (TRL's multi_objective_aggregation)."""

    SUM_THEN_NORMALIZE = "sum_then_normalize"  # the weighted sum, then the advantage estimator
    NORMALIZE_THEN_SUM = "normalize_then_sum"  # GDPO: each reward normalised in its group, summed, then over the batch


class ISCorrection(enum.Enum):
    """Importance weights between the rollout engine's log-probs and the learner's on the same
    tokens (TRL's vllm_importance_sampling_mode, verl's rollout correction): w = pi_learner /
    pi_sampler, per token or per sequence, truncated at the cap (w <- min(w, cap)) or masked
    above it (w <- 0), multiplying each token's policy loss."""

    AUTO = "auto"  # token_truncate wherever the learner rescores (the numbers differ); off otherwise
    OFF = "off"
    TOKEN_TRUNCATE = "token_truncate"
    TOKEN_MASK = "token_mask"
    SEQUENCE_TRUNCATE = "sequence_truncate"
    SEQUENCE_MASK = "sequence_mask"


class RatioLevel(enum.Enum):
    TOKEN = "token"  # PPO/GRPO per-token importance ratio
    SEQUENCE = "sequence"  # GSPO: exp(mean over the sequence of the log-ratio)


_ROLLOUT_ADDED = {"is_correction": "auto", "is_cap": 2.0}  # RolloutConfig fields added after runs existed


# GRPOConfig fields added after runs existed, with the values that reproduce what ran before them
_GRPO_ADDED = {
    "policy_loss": "clip",
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "entropy_coef": 0.0,
    "top_entropy_quantile": 1.0,
    "multi_objective_aggregation": "sum_then_normalize",
}


@section(path="train.grpo")
class GRPOConfig(Section):
    """The GRPO objective and its rollout batch."""

    # G, completions per prompt
    num_generations: int = field(8, doc="Completions per prompt (G)", ge=2, api_max=256)
    prompts_per_step: int = field(8, doc="Prompts per step (P)", ge=1, api_max=4096)
    advantage: AdvantageEstimator = field(
        AdvantageEstimator.GRPO, doc="grpo: (r - mean)/std; dr_grpo: r - mean; rloo: leave-one-out"
    )
    scale_rewards: RewardScaling = field(
        RewardScaling.GROUP, doc="Divide advantages by the std of the group, the batch, or not at all"
    )
    advantage_eps: float = field(1e-4, doc="Added to the std", gt=0)
    epsilon_low: float = field(0.2, doc="Lower clip range", ge=0, lt=1)
    # DAPO's clip-higher: raise to 0.28
    epsilon_high: float = field(0.2, doc="Upper clip range (DAPO clip-higher: 0.28)", ge=0)
    # e.g. 3.0: caps the loss of negative advantages at c·|A|
    dual_clip: float | None = field(None, doc="Dual-clip constant (> 1); empty: off", gt=1)
    ratio_level: RatioLevel = field(RatioLevel.TOKEN, doc="Importance ratio per token (GRPO) or per sequence (GSPO)")
    loss_aggregation: LossAggregation = field(
        LossAggregation.SEQ_MEAN_TOKEN_MEAN,
        doc="token_mean (DAPO), seq_mean_token_mean (GRPO), seq_mean_token_sum_norm (Dr. GRPO), bnpo",
    )
    policy_loss: PolicyLoss = field(
        PolicyLoss.CLIP, doc="clip (PPO/GRPO), cispo (clipped IS weight; epsilon_high is the cap, e.g. 5), sapo"
    )
    sapo_temperature_pos: float = field(1.0, doc="SAPO gate temperature for tokens with A > 0", gt=0)
    sapo_temperature_neg: float = field(1.05, doc="SAPO gate temperature for tokens with A <= 0", gt=0)
    # verl's entropy_coeff: loss - coef * entropy, aggregated like the loss
    entropy_coef: float = field(0.0, doc="Entropy bonus: the loss minus this times the mean token entropy", ge=0)
    # TRL: only the tokens at or above this quantile of entropy (in each micro-batch) get the policy loss
    top_entropy_quantile: float = field(
        1.0, doc="Policy loss on the top fraction of tokens by entropy (TRL; 0.2: the top 20 %); 1: all", gt=0, le=1
    )
    multi_objective_aggregation: RewardAggregation = field(
        RewardAggregation.SUM_THEN_NORMALIZE,
        doc="sum_then_normalize: advantage of the weighted sum; normalize_then_sum: GDPO, per reward, then the batch",
    )
    # KL coefficient; 0 = no reference model at all
    beta: float = field(0.0, doc="KL coefficient; 0: no reference model", ge=0)
    kl_estimator: KLEstimator = field(KLEstimator.K3, doc="KL estimator")
    # passes over each rollout batch (mu); > 1 is off-policy
    num_iterations: int = field(1, doc="Passes over each rollout batch", ge=1, api_max=64)
    # optimizer updates per pass
    minibatches_per_rollout: int = field(1, doc="Optimizer updates per pass", ge=1)
    # micro-batches summed into one update; "auto": the fewest that fit the devices (grpo_core.config.memory)
    grad_accum_steps: int | typing.Literal["auto"] = field(
        "auto", doc="Micro-batches summed into one update; auto: the fewest that fit the devices", ge=1
    )
    # DAPO: no loss on completions cut at max_new_tokens
    mask_truncated_completions: bool = field(False, doc="No loss on completions cut at max_new_tokens")
    # DAPO: drop zero-variance groups and refill
    dynamic_sampling: bool = field(False, doc="Drop groups whose rewards are all equal and sample again")
    # bound on extra rollouts to refill a dynamic-sampling batch
    max_sampling_rounds: int = field(3, doc="Bound on sampling rounds per step", ge=1, api_max=64)

    def validate(self) -> None:
        check(
            not (self.advantage is AdvantageEstimator.DR_GRPO and self.scale_rewards is not RewardScaling.NONE),
            "grpo.advantage=dr_grpo does not divide by a std; set grpo.scale_rewards=none "
            f"(got {self.scale_rewards.value}) or use grpo.advantage=grpo",
        )
        # RLOO divided by the group's std is G/(G-1) x the GRPO advantage: under Adam, GRPO again
        # (verl and Tunix never scale it)
        check(
            not (self.advantage is AdvantageEstimator.RLOO and self.scale_rewards is not RewardScaling.NONE),
            "grpo.advantage=rloo is the leave-one-out baseline unscaled; set grpo.scale_rewards=none "
            f"(got {self.scale_rewards.value}: divided by a std it is G/(G-1) x the grpo advantage)",
        )
        check(
            self.policy_loss is not PolicyLoss.CISPO or self.epsilon_high >= 1,
            "grpo.policy_loss=cispo caps the importance weight at grpo.epsilon_high itself (as TRL does; 5.0 is "
            f"the usual value), so it must be >= 1, got {self.epsilon_high}",
        )
        accum = 1 if self.grad_accum_steps == "auto" else self.grad_accum_steps
        per_update = self.minibatches_per_rollout * accum
        check(
            self.prompts_per_step % per_update == 0,
            f"grpo.prompts_per_step ({self.prompts_per_step}) must divide evenly into "
            f"minibatches_per_rollout * grad_accum_steps ({per_update}) micro-batches of whole groups",
        )

    def warnings(self) -> list[str]:
        """Combinations that run but that TRL and the papers advise against."""
        out = []
        if self.ratio_level is RatioLevel.SEQUENCE and self.loss_aggregation in (
            LossAggregation.TOKEN_MEAN,
            LossAggregation.BNPO,
        ):
            out.append(
                f"grpo.ratio_level=sequence (GSPO) with grpo.loss_aggregation={self.loss_aggregation.value}: GSPO "
                "weighs each sequence once (seq_mean_token_mean); a token-level mean gives long sequences more weight"
            )
        if self.policy_loss is not PolicyLoss.CLIP and self.dual_clip is not None:
            out.append(f"grpo.dual_clip applies to policy_loss=clip only; with {self.policy_loss.value} it is unused")
        return out

    def accumulation_choices(self) -> list[int]:
        """The grad_accum_steps values this batch allows (micro-batches of whole groups), fewest first."""
        per_pass = self.prompts_per_step // self.minibatches_per_rollout
        return [a for a in range(1, per_pass + 1) if per_pass % a == 0]

    @property
    def batch_size(self) -> int:
        """Completions per rollout."""
        return self.prompts_per_step * self.num_generations

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0


# ----------------------------------------------------------------------------------------------
# Optimizer


@section(path="train.optimizer")
class OptimizerConfig(Section):
    """AdamW with linear warmup and cosine decay, and global-norm gradient clipping."""

    learning_rate: float = field(1e-6, doc="Peak learning rate (AdamW)", gt=0)
    warmup_steps: int = field(0, doc="Linear warmup steps", ge=0)
    # None: cosine over the whole run; 0: constant after warmup
    decay_steps: int | None = field(None, doc="Cosine decay steps; empty: the whole run, 0: constant", ge=0)
    min_lr_ratio: float = field(0.1, doc="Final learning rate as a fraction of the peak", ge=0, le=1)
    b1: float = field(0.9, doc="Adam beta1", ge=0, lt=1)
    b2: float = field(0.99, doc="Adam beta2", ge=0, lt=1)
    eps: float = field(1e-8, doc="Adam epsilon", gt=0)
    weight_decay: float = field(0.0, doc="Decoupled weight decay", ge=0)
    max_grad_norm: float | None = field(1.0, doc="Global-norm gradient clipping; empty: off", gt=0)
    # dtype of Adam's first moment (optax mu_dtype); null: the parameters' dtype. bfloat16 halves it.
    mu_dtype: DType | None = field(
        None, doc="dtype of Adam's first moment (bfloat16 halves it); empty: the parameters'"
    )


# ----------------------------------------------------------------------------------------------
# Rollout engine


class RolloutEngineKind(enum.Enum):
    JAX = "jax"  # the built-in sampler (grpo_core.generate.sampler): any backend, multi-host
    SGLANG = "sglang"  # sglang-jax in the worker's process: single host, TPU v4+ (or CPU for tests)
    HTTP = "http"  # an OpenAI-compatible server (sglang-jax, SGLang, vLLM)

    @classmethod
    def _missing_(cls, value):
        return cls.SGLANG if value == "sglang-jax" else None


class RolloutLayout(enum.Enum):
    """Where the rollout runs relative to the learner (grpo_core.rl.overlap)."""

    COLOCATED = "colocated"  # in the learner's process, on its devices (with max_staleness >= 1: in a thread)
    SPLIT = "split"  # a second local JAX process on devices (CPU cores) of its own, sent the weights each step


class HttpApi(enum.Enum):
    OPENAI = "openai"  # POST /v1/completions, token-id prompts, logprobs=1
    SGLANG = "sglang"  # POST /generate with input_ids (SGLang / sglang-jax): exact token ids back


@section(path="train.rollout")
class RolloutConfig(Section):
    """Which engine draws the completions, and its knobs (grpo_core.engines).

    Every wait on an engine has a time limit whose error names what was waited for: the engine
    or server start, one generate call (per HTTP request, with retries), one weight sync."""

    engine: RolloutEngineKind = field(
        RolloutEngineKind.JAX,
        doc=(
            "Rollout engine: jax (built-in sampler, multi-host), sglang (sglang-jax in the worker's process: one host,"
            " TPU v4+; the worker runs in .venv-sglang) or http (an OpenAI-compatible server)"
        ),
    )
    # in-process engine start, or an owned server's start
    start_timeout_s: float = field(900.0, doc="Limit on an engine's or a server's start, seconds", gt=0)
    # one rollout (HTTP: one request)
    generate_timeout_s: float = field(900.0, doc="Limit on one rollout (http: one request), seconds", gt=0)
    # one weight sync (in memory, or export + server reload)
    sync_timeout_s: float = field(600.0, doc="Limit on one weight sync (http: export + reload), seconds", gt=0)
    # old_logp rescored by the learner instead of the engine's own: null = wherever the sampler's
    # numbers can differ from the learner's (sglang and http engines: other kernels; the built-in
    # sampler in bfloat16: decoding with a KV cache rounds differently from the learner's forward).
    # The built-in sampler in float32 keeps its own: they agree to ~1e-6 (tests/test_learner.py).
    recompute_logprobs: bool | None = field(
        None,
        doc=(
            "old_logp rescored by the learner instead of the engine's; empty: sglang, http and bfloat16 yes, the "
            "built-in sampler in float32 no"
        ),
    )
    is_correction: ISCorrection = field(
        ISCorrection.AUTO,
        doc="Sampler/learner mismatch correction: token_/sequence_ truncate or mask at is_cap, off; auto: "
        "token_truncate wherever old_logp is rescored by the learner",
    )
    is_cap: float = field(2.0, doc="Cap C of the mismatch importance weights (TRL's importance_sampling_cap)", gt=1)
    # sglang-jax: the in-process engine, and the servers the http engine starts (server: sglang-jax)
    # engine weights/compute; null: the policy's compute dtype
    dtype: str | None = field(
        None, doc="sglang/http engine dtype (float32, bfloat16); empty: the policy's", trust=Trust.SAFE
    )
    # share of device memory for weights + KV cache
    mem_fraction_static: float | None = field(
        None, doc="sglang: share of device memory for its weights and KV cache", gt=0, lt=1
    )
    # KV cache tokens; null: sglang's choice (CPU: a small default)
    max_total_tokens: int | None = field(None, doc="sglang: KV-cache tokens; empty: sglang's choice", ge=1)
    # null: the model's max_position_embeddings
    context_length: int | None = field(None, doc="sglang: longest prompt + completion; empty: the model's", ge=1)
    # null: one rollout batch (prompts x generations)
    max_running_requests: int | None = field(None, doc="sglang: concurrent rows; empty: one rollout batch", ge=1)
    # skip sglang's start-up compilation (faster start, slower first batches)
    disable_precompile: bool = field(
        False, doc="sglang: skip start-up compilation (faster start, slower first rollouts)"
    )
    attention_backend: str | None = field(
        None, doc='null: "native" on CPU, sglang\'s default elsewhere', trust=Trust.SAFE
    )
    deterministic: bool = field(True, doc="seeded per-row sampling: a resumed run redraws the same completions")
    # sglang-jax's overlap scheduler (CPU scheduling of the next batch during the current one).
    # Off by default: with it on, 3 of 6 sglang-jax 0.1.0rc0 servers started on CPU returned wrong
    # greedy tokens for the whole of their life (0 of 6 with it off, and 0 in process).
    overlap_schedule: bool = field(
        False, doc="sglang: schedule the next batch while the current one runs (off: wrong tokens seen on CPU)"
    )
    # http
    # an already running server (not restarted here), e.g. http://10.0.0.2:30000
    url: str | None = field(None, doc="http: a running server (with train.rollout.reload_route)", trust=Trust.ADDRESS)
    api: HttpApi = field(HttpApi.OPENAI, doc="http: the server's API (openai: /v1/completions; sglang: /generate)")
    model_name: str | None = field(
        None, doc='the "model" of each request; null: the server\'s first /v1/models entry', trust=Trust.SAFE
    )
    # "sglang-jax": start (and restart on each refresh) a server on 127.0.0.1
    server: str | None = field(
        None, doc="http: 'sglang-jax' starts and restarts a server on 127.0.0.1 with each export", trust=Trust.SAFE
    )
    server_args: tuple[str, ...] = field((), doc="extra command-line arguments of that server", trust=Trust.PROGRAM)
    # or any server this run starts and restarts itself, e.g. ["vllm", "serve", "{model}", "--port",
    # "{port}"]: {model} (the exported folder), {port}, {host} and {python} are filled in
    server_command: tuple[str, ...] = field(
        (),
        doc="http: a server this run starts and restarts, e.g. vllm serve {model} --port {port}",
        trust=Trust.PROGRAM,
    )
    reload_route: str | None = field(
        None, doc='POST {"model_path": folder} to reload weights (SGLang: /update_weights_from_disk)', trust=Trust.SAFE
    )
    # http: steps between exports of the policy to the server
    sync_every: int = field(1, doc="http: steps between exports of the policy to the server", ge=1)
    export_dir: str | None = field(
        None, doc="http: where exports go (must be readable by the server); null: a temp folder", trust=Trust.WRITES
    )
    request_retries: int = field(2, doc="http: retries of a failed or timed-out request", ge=0, api_max=10)
    # Where the rollout runs (grpo_core.rl.overlap). Neither changes what a step computes (each
    # batch comes from the policy version train.max_staleness names, with the same PRNG keys and
    # prompts): not in the training hash, like the mesh, and a run may resume in another layout.
    layout: RolloutLayout = field(
        RolloutLayout.COLOCATED,
        doc="colocated: the rollout in the learner's process and devices; split: a second local process on cores of "
        "its own (CPU backend), sent the weights after every update",
    )
    devices: int | None = field(
        None,
        doc="split: the CPU cores the rollout process takes (the learner keeps the rest; grpo check --target: the "
        "chips); empty: half",
        ge=1,
    )

    def validate(self) -> None:
        check(
            self.dtype in (None, "float32", "bfloat16"),
            f"train.rollout.dtype must be float32, bfloat16 or null, got {self.dtype!r}",
        )
        check(
            self.server in (None, "sglang-jax"),
            f"train.rollout.server must be 'sglang-jax' or null (use url for another server), got {self.server!r}",
        )
        check(
            self.reload_route is None or self.reload_route.startswith("/"),
            f"train.rollout.reload_route must be a path like /update_weights_from_disk, got {self.reload_route!r}",
        )
        if self.engine is RolloutEngineKind.HTTP:
            given = [n for n in ("url", "server", "server_command") if getattr(self, n)]
            check(
                len(given) == 1,
                "train.rollout.engine=http needs exactly one of train.rollout.url (a running server), "
                "train.rollout.server=sglang-jax or train.rollout.server_command (a server started here); "
                f"got {given or 'none'}",
            )
            check(
                not self.server_command or "{model}" in " ".join(self.server_command),
                (
                    f"train.rollout.server_command must name the model folder as {{model}}, got "
                    f"{list(self.server_command)}"
                ),
            )
            check(
                self.url is None or self.reload_route is not None,
                f"train.rollout.url={self.url!r} is a server this run cannot restart: set train.rollout.reload_route "
                "(SGLang: /update_weights_from_disk) so it serves each exported policy, or use "
                "train.rollout.server=sglang-jax",
            )

    def split_counts(self, available: int, what: str = "CPU cores") -> tuple[int, int]:
        """(the learner's, the rollout's) share of `available` devices or cores under layout=split:
        train.rollout.devices for the rollout (by default half), the rest for the learner."""
        rollout = self.devices if self.devices is not None else max(1, available // 2)
        check(
            available >= 2 and rollout < available,
            f"train.rollout.layout=split gives the rollout {rollout} of {available} {what} and the learner the rest, "
            "which leaves the learner none: set train.rollout.devices lower, or use train.rollout.layout=colocated",
        )
        return available - rollout, rollout

    def check_overlap(self, max_staleness: int) -> None:
        """What the asynchronous rollout (train.max_staleness >= 1) and the split layout support so far."""
        moved = self.layout is RolloutLayout.SPLIT or max_staleness > 0
        check(
            not moved or self.engine is RolloutEngineKind.JAX,
            f"train.max_staleness={max_staleness} with train.rollout.layout={self.layout.value} runs the built-in "
            f"sampler (train.rollout.engine=jax) for now, got engine={self.engine.value}: the sglang and http engines "
            "already draw in a server of their own; use max_staleness: 0 and layout: colocated with them",
        )

    def is_mode(self, compute_dtype: DType = DType.FLOAT32) -> ISCorrection:
        """The mismatch correction in force: `auto` resolved (on where the learner rescores)."""
        if self.is_correction is ISCorrection.AUTO:
            return ISCorrection.TOKEN_TRUNCATE if self.learner_logprobs(compute_dtype) else ISCorrection.OFF
        return self.is_correction

    def learner_logprobs(self, compute_dtype: DType = DType.FLOAT32) -> bool:
        """Whether the learner rescores old_logp (see recompute_logprobs) for a policy computing in `compute_dtype`."""
        if self.recompute_logprobs is not None:
            return self.recompute_logprobs
        return self.engine is not RolloutEngineKind.JAX or compute_dtype is DType.BFLOAT16

    def result_fields(self) -> dict[str, Any] | None:
        """The fields that change what training computes (part of the training hash); None for
        the built-in engine, so runs that never set this section keep their hashes. Addresses,
        time limits and memory knobs change no result."""
        # the mismatch correction, once set (runs from before it keep their hashes)
        correction = {
            k: v for k, v in self.to_dict().items() if k in ("is_correction", "is_cap") and v != _ROLLOUT_ADDED[k]
        }
        if self.engine is RolloutEngineKind.JAX:
            return correction or None
        keep = ["engine", "dtype", "deterministic"]
        if self.engine is RolloutEngineKind.HTTP:
            keep += ["api", "sync_every"]
        out = dict({k: v for k, v in self.to_dict().items() if k in keep}, learner_logprobs=self.learner_logprobs())
        return dict(out, **correction)


# ----------------------------------------------------------------------------------------------
# Device mesh


MESH_AXES = ("data", "fsdp", "tensor")


@section(path="train.mesh")
class MeshShape(Section):
    """Sizes of the mesh axes (grpo_core.runtime.mesh). data splits the batch only; fsdp splits the batch
    and every parameter's hidden dimension, optimizer state included (ZeRO-3); tensor splits
    attention heads, the MLP width and the vocabulary. -1 on one axis: every device the other
    axes leave, so the default runs on any number of devices."""

    data: int = field(1, doc="Mesh axis that splits batches only; -1: the devices the other axes leave", ge=-1)
    fsdp: int = field(
        -1,
        doc=(
            "Mesh axis that splits batches and every parameter and optimizer moment (ZeRO-3); -1: the devices the "
            "other axes leave"
        ),
        ge=-1,
    )
    tensor: int = field(
        1, doc="Mesh axis that splits heads, MLP width and vocabulary (Megatron-style); -1: the rest", ge=-1
    )

    def validate(self) -> None:
        for name in MESH_AXES:
            v = getattr(self, name)
            check(v == -1 or v >= 1, f"{self.section_path}.{name} must be a positive integer or -1 (the rest), got {v}")
        rest = [f"{self.section_path}.{n}" for n in MESH_AXES if getattr(self, n) == -1]
        check(len(rest) <= 1, f"at most one mesh axis may be -1, got {' and '.join(rest)}")

    def sizes(self, num_devices: int, field: str = "train.mesh") -> tuple[int, ...]:
        """The axis sizes on `num_devices` devices, or ConfigError naming the field."""
        given = {n: getattr(self, n) for n in MESH_AXES}
        fixed = 1
        for v in given.values():
            fixed *= v if v > 0 else 1
        shown = ", ".join(f"{n}: {v}" for n, v in given.items())
        if -1 not in given.values():
            check(
                fixed == num_devices,
                f"{field} {{{shown}}} needs {fixed} devices, but this run has {num_devices}; "
                f"set one axis to -1 to take the rest",
            )
            return tuple(given.values())
        check(
            num_devices % fixed == 0,
            f"{field} {{{shown}}}: {num_devices} devices do not divide into axes of the fixed sizes (product {fixed})",
        )
        return tuple(v if v > 0 else num_devices // fixed for v in given.values())


@section(path="train.mesh")
class MeshConfig(MeshShape):
    """The `train.mesh` section: the learner's mesh (parameters, optimizer state, update batches)
    and, optionally, other layouts of the same devices for the rollout (the sampler's copy of
    the weights, its prompts and KV cache) and for the reference policy. null: the learner's
    mesh, and no second copy of the weights. Not part of the training hash: a run resumes on
    another mesh (Orbax restores onto the new shardings)."""

    rollout: MeshShape | None = field(
        None,
        doc=(
            "Another layout of the same devices for the sampler ({data, fsdp, tensor}); empty: the learner's mesh and "
            "no second copy of the weights"
        ),
    )
    reference: MeshShape | None = field(
        None, doc="Another layout of the same devices for the KL reference; empty: the learner's"
    )


# ----------------------------------------------------------------------------------------------
# Training run (engine level)


@section(path="train")
class TrainConfig(Section):
    """Everything the engine needs for one training run, apart from the model and the task."""

    grpo: GRPOConfig = field(factory=GRPOConfig)
    sampling: SamplingConfig = field(factory=SamplingConfig)
    optimizer: OptimizerConfig = field(factory=OptimizerConfig)
    rollout: RolloutConfig = field(factory=RolloutConfig)
    mesh: MeshConfig = field(factory=MeshConfig)
    agent: AgentConfig = field(
        factory=AgentConfig,
        doc="Episodes with tools or an environment (agentic GRPO); empty: single-turn completions",
    )
    num_steps: int | typing.Literal["auto"] = field(
        100,
        doc="GRPO steps in the whole run; auto: train.num_epochs passes over the prepared training rows "
        "(found before the run is named: grpo check prints it)",
        ge=1,
        api_max=1_000_000,
    )
    # with num_steps: auto, how many steps: ceil(num_epochs x training rows / prompts_per_step)
    num_epochs: float = field(
        3.0,
        doc="With train.num_steps: auto, passes over the prepared training rows (TRL's num_train_epochs)",
        gt=0,
        api_max=1000,
    )
    seed: int = field(0, doc="Seed of every step's sampling", ge=0)
    # AReaL's max_head_offpolicyness, prime-rl's async level: the batch of step s is drawn by the
    # policy after max(0, s - k) updates while the learner updates (grpo_core.rl.overlap); 0 is the
    # synchronous run, the same code with no lag. Each batch keeps its version; none older is trained.
    max_staleness: int = field(
        0,
        doc="Asynchronous rollout: the batch of step s is drawn by the policy of step max(0, s - k) while earlier "
        "steps update (k policy versions of lag at most); 0: synchronous",
        ge=0,
        api_max=8,
    )
    log_every: int | None = field(
        None, doc="Steps between the training task's step log lines; empty: about 50 a run (ceil(num_steps / 50))", ge=1
    )
    # A reward function that never returns would otherwise hold the worker until the stage's own
    # time limit (pipeline.train_timeout_s) and then be retried; past this the worker stops with a
    # reward error naming the function and the batch, which is not retried. Changes no result.
    reward_timeout_s: float = field(
        300.0,
        doc="Limit on one reward function's call on one batch of completions (training and evaluation), seconds; "
        "past it the run fails with a reward error, not retried",
        gt=0,
    )
    # Memory at real shapes (grpo_core.config.memory): the decoder layers' rematerialisation, and the size
    # of one vocabulary chunk's f32 logits when log-probs are computed (grpo_core.rl.logprobs). Neither
    # changes a result: not in the training hash.
    remat: RematPolicy = field(
        RematPolicy.AUTO,
        doc=(
            "What each decoder layer keeps for the backward pass: none (all, fastest), dots (the matmul outputs), full"
            " (its input only); auto: the fastest that fits the devices"
        ),
    )
    logits_chunk_mib: int = field(
        64,
        doc=(
            "Size of one vocabulary chunk's f32 logits when log-probs are computed (MiB); on a GPU or TPU the"
            " count is rounded to a power of two that divides the vocabulary, up to 4x this"
        ),
        ge=1,
    )

    def validate(self) -> None:
        self.rollout.check_overlap(self.max_staleness)
        check(
            not self.sampling.greedy,
            "train.sampling.temperature must be > 0 for training: greedy decoding gives all "
            f"{self.grpo.num_generations} completions of a group the same reward, so every advantage is 0",
        )

    def steps_for(self, train_rows: int) -> int:
        """num_steps: auto for `train_rows` prepared training rows: num_epochs passes, whole steps."""
        return max(1, math.ceil(self.num_epochs * train_rows / self.grpo.prompts_per_step))

    def hash_fields(self) -> dict[str, Any]:
        """to_dict() less what changes no result (see RolloutConfig.result_fields)."""
        out = self.to_dict()
        rollout = self.rollout.result_fields()
        if rollout is None:
            del out["rollout"]
        else:
            out["rollout"] = rollout
        agent = self.agent.hash_fields()
        if agent is None:  # single-turn: its hashes stay as they were before episodes existed
            del out["agent"]
        else:
            out["agent"] = agent
        del out["mesh"]  # where arrays live changes results only within float tolerance
        if self.max_staleness == 0:  # synchronous: hashed as before the field existed
            del out["max_staleness"]
        del out["remat"], out["logits_chunk_mib"]  # how memory is spent: the same numbers
        del out["reward_timeout_s"]  # a time limit: a run that finishes computes the same numbers
        out["log_every"] = 1  # how often the task logs changes no result; 1 is what runs before it was read hashed
        # num_steps: auto is resolved into a number (grpo_core.resolve.resolve_run) before a run is named:
        # the number is hashed, the epochs it came from are not (runs from before keep their hashes)
        del out["num_epochs"]
        # Accumulation sums exact per-token weights (algo.token_weights): the same update within
        # float tolerance, so it is hashed as 1, except under BNPO, which normalises per micro-batch.
        if self.grpo.loss_aggregation is not LossAggregation.BNPO:
            out["grpo"]["grad_accum_steps"] = 1
        if self.optimizer.mu_dtype is None:  # runs that never set it keep their hashes
            del out["optimizer"]["mu_dtype"]
        for k, default in _GRPO_ADDED.items():  # fields added later: at their defaults, hashes stay as they were
            if out["grpo"].get(k) == default:
                del out["grpo"][k]
        return out

    @property
    def completion_tokens(self) -> int:
        """N, the tokens after each prompt the learner trains on: a completion's, or with
        train.agent an episode's (its turns, tool results and glue)."""
        n = self.sampling.max_new_tokens
        return self.agent.episode_tokens(n) if self.agent.enabled else n

    def rescores_in_update(self, compute_dtype: DType = DType.FLOAT32) -> bool:
        """Whether the learner's rescoring of old_logp (RolloutConfig.learner_logprobs) happens in the
        update's own forward pass, not in a pass of its own: with one optimizer update per rollout
        (one iteration, one minibatch) the policy that scores the samples is the one the update
        differentiates, so old_logp is its own log-probs held constant (stop_gradient), as TRL takes
        them when num_iterations is 1. The same numbers, one forward pass and one program fewer."""
        g = self.grpo
        # lagging batches (max_staleness >= 1): the update's policy is not the one that drew them, so
        # its forward cannot stand for theirs (the ratio would be 1 and the lag hidden); the rollout
        # side scores them with the policy that drew them (grpo_core.rl.overlap)
        one = g.num_iterations == 1 and g.minibatches_per_rollout == 1 and self.max_staleness == 0
        return self.rollout.learner_logprobs(compute_dtype) and one

    @property
    def memory_resolved(self) -> bool:
        """Whether remat and grad_accum_steps are chosen (not auto): what the learner needs."""
        return self.remat is not RematPolicy.AUTO and self.grpo.grad_accum_steps != "auto"
