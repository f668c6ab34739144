"""Configuration types, one per concern, validated on construction.

Every check repeats the bad value and names the field, so a user who mistyped a YAML key or a
``--set`` override sees what to fix: ``num_generations must be >= 2, got 1``.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """A configuration value a user chose is invalid. The message names the field."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _enum(cls: type[enum.Enum], value: Any, field: str) -> enum.Enum:
    """Accept an enum member or its string value (from YAML / CLI overrides)."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(m.value for m in cls)
        raise ConfigError(f"{field} must be one of {choices}; got {value!r}") from None


class _Config:
    """Shared helpers: enum coercion from strings, dict round-trips, `replace`."""

    _enums: dict[str, type[enum.Enum]] = {}

    def _normalize(self) -> None:
        """Coerce values from YAML/CLI to the declared field types (`5e-4` arrives as a string
        from YAML), or fail naming the field."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            name = f"{type(self).__name__}.{f.name}"
            value = getattr(self, f.name)
            if f.name in self._enums:
                optional = value is None and type(None) in typing.get_args(hints[f.name])
                value = value if optional else _enum(self._enums[f.name], value, name)
            else:
                value = _coerce(hints[f.name], value, name)
            object.__setattr__(self, f.name, value)

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, enum.Enum):
                v = v.value
            elif isinstance(v, _Config):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        _check(not unknown, f"{cls.__name__}: unknown field(s) {unknown}; known: {sorted(names)}")
        kwargs = dict(data)
        for f in dataclasses.fields(cls):
            sub = _SUBCONFIGS.get((cls.__name__, f.name))
            if sub is not None and isinstance(kwargs.get(f.name), dict):
                kwargs[f.name] = sub.from_dict(kwargs[f.name])
            elif isinstance(kwargs.get(f.name), list):
                kwargs[f.name] = tuple(kwargs[f.name])
        return cls(**kwargs)


_SUBCONFIGS: dict[tuple[str, str], type[_Config]] = {}


def _coerce(hint, value, name: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        words = [w for a in args if typing.get_origin(a) is typing.Literal for w in typing.get_args(a)]
        if isinstance(value, str) and value in words:  # a word such as "auto" beside a number
            return value
        hint = next(a for a in args if a is not type(None) and typing.get_origin(a) is not typing.Literal)
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    bad = ConfigError(f"{name} must be {getattr(hint, '__name__', hint)}, got {value!r}")
    if hint is float:
        if isinstance(value, bool):
            raise bad
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad from None
    if hint is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise bad
        try:
            return int(value)
        except (TypeError, ValueError):
            raise bad from None
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise bad
        return value
    if origin is tuple and args and args[-1] is Ellipsis:
        if not isinstance(value, (list, tuple)):
            raise bad
        return tuple(_coerce(args[0], v, f"{name}[{i}]") for i, v in enumerate(value))
    return value


# ----------------------------------------------------------------------------------------------
# Model


class DType(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Config):
    """A Qwen/Llama-style decoder. Field names follow Hugging Face configs one to one."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    max_position_embeddings: int = 32768
    # Llama 3 "rope_scaling" = {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    dtype: DType = DType.FLOAT32  # compute dtype
    param_dtype: DType = DType.FLOAT32

    _enums = {"dtype": DType, "param_dtype": DType}

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        self._normalize()
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v >= 1, f"model.{name} must be a positive integer, got {v!r}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0,
               f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
               f"model.num_key_value_heads ({self.num_key_value_heads})")
        _check(self.head_dim % 2 == 0, f"model.head_dim must be even for RoPE, got {self.head_dim}")
        _check(self.rms_norm_eps > 0, f"model.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        _check(self.rope_theta > 0, f"model.rope_theta must be > 0, got {self.rope_theta}")

    def num_params(self) -> int:
        h, d, kv, nh = self.hidden_size, self.head_dim, self.num_key_value_heads, self.num_attention_heads
        attn = h * nh * d + 2 * h * kv * d + nh * d * h
        if self.attention_bias:
            attn += nh * d + 2 * kv * d
        if self.qk_norm:
            attn += 2 * d
        mlp = 3 * h * self.intermediate_size
        layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return emb + self.num_hidden_layers * layer + h


# ----------------------------------------------------------------------------------------------
# Sampling


@dataclasses.dataclass(frozen=True)
class SamplingConfig(_Config):
    """How completions are drawn. temperature 0 means greedy."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    # Prompts are left-padded to the smallest bucket that holds them: one compiled program per
    # bucket, and at most ~25% padding instead of padding everything to the longest prompt.
    prompt_buckets: tuple[int, ...] = (4, 8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256,
                                       320, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096)
    ignore_eos: bool = False  # benchmarks force every completion to max_new_tokens

    def __post_init__(self) -> None:
        self._normalize()
        _check(self.max_new_tokens >= 1, f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(self.temperature >= 0, f"sampling.temperature must be >= 0, got {self.temperature}")
        _check(self.top_k >= 0, f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        _check(0 < self.top_p <= 1, f"sampling.top_p must be in (0, 1], got {self.top_p}")
        b = tuple(self.prompt_buckets)
        _check(len(b) > 0 and all(isinstance(x, int) and x > 0 for x in b) and list(b) == sorted(set(b)),
               f"sampling.prompt_buckets must be increasing positive integers, got {b}")
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


class RatioLevel(enum.Enum):
    TOKEN = "token"  # PPO/GRPO per-token importance ratio
    SEQUENCE = "sequence"  # GSPO: exp(mean over the sequence of the log-ratio)


@dataclasses.dataclass(frozen=True)
class GRPOConfig(_Config):
    """The GRPO objective and its rollout batch."""

    num_generations: int = 8  # G, completions per prompt
    prompts_per_step: int = 8
    advantage: AdvantageEstimator = AdvantageEstimator.GRPO
    scale_rewards: RewardScaling = RewardScaling.GROUP
    advantage_eps: float = 1e-4
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2  # DAPO's clip-higher: raise to 0.28
    dual_clip: float | None = None  # e.g. 3.0: caps the loss of negative advantages at c·|A|
    ratio_level: RatioLevel = RatioLevel.TOKEN
    loss_aggregation: LossAggregation = LossAggregation.SEQ_MEAN_TOKEN_MEAN
    beta: float = 0.0  # KL coefficient; 0 = no reference model at all
    kl_estimator: KLEstimator = KLEstimator.K3
    num_iterations: int = 1  # passes over each rollout batch (mu); > 1 is off-policy
    minibatches_per_rollout: int = 1  # optimizer updates per pass
    # micro-batches summed into one update; "auto": the fewest that fit the devices (grpo_core.config.memory)
    grad_accum_steps: int | typing.Literal["auto"] = "auto"
    mask_truncated_completions: bool = False  # DAPO: no loss on completions cut at max_new_tokens
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups and refill
    max_sampling_rounds: int = 3  # bound on extra rollouts to refill a dynamic-sampling batch

    _enums = {"advantage": AdvantageEstimator, "scale_rewards": RewardScaling,
              "loss_aggregation": LossAggregation, "kl_estimator": KLEstimator,
              "ratio_level": RatioLevel}

    def __post_init__(self) -> None:
        self._normalize()
        _check(self.num_generations >= 2, f"grpo.num_generations must be >= 2, got {self.num_generations}")
        _check(self.prompts_per_step >= 1, f"grpo.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        _check(self.advantage_eps > 0, f"grpo.advantage_eps must be > 0, got {self.advantage_eps}")
        _check(0 <= self.epsilon_low < 1, f"grpo.epsilon_low must be in [0, 1), got {self.epsilon_low}")
        _check(self.epsilon_high >= 0, f"grpo.epsilon_high must be >= 0, got {self.epsilon_high}")
        _check(self.dual_clip is None or self.dual_clip > 1,
               f"grpo.dual_clip must be > 1 (or null to disable), got {self.dual_clip}")
        _check(self.beta >= 0, f"grpo.beta must be >= 0, got {self.beta}")
        _check(self.num_iterations >= 1, f"grpo.num_iterations must be >= 1, got {self.num_iterations}")
        _check(self.minibatches_per_rollout >= 1,
               f"grpo.minibatches_per_rollout must be >= 1, got {self.minibatches_per_rollout}")
        _check(self.grad_accum_steps == "auto" or self.grad_accum_steps >= 1,
               f"grpo.grad_accum_steps must be >= 1 or auto, got {self.grad_accum_steps}")
        _check(self.max_sampling_rounds >= 1,
               f"grpo.max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")
        _check(not (self.advantage is AdvantageEstimator.DR_GRPO and self.scale_rewards is not RewardScaling.NONE),
               "grpo.advantage=dr_grpo does not divide by a std; set grpo.scale_rewards=none "
               f"(got {self.scale_rewards.value}) or use grpo.advantage=grpo")
        accum = 1 if self.grad_accum_steps == "auto" else self.grad_accum_steps
        per_update = self.minibatches_per_rollout * accum
        _check(self.prompts_per_step % per_update == 0,
               f"grpo.prompts_per_step ({self.prompts_per_step}) must divide evenly into "
               f"minibatches_per_rollout * grad_accum_steps ({per_update}) micro-batches of whole groups")

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


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(_Config):
    """AdamW with linear warmup and cosine decay, and global-norm gradient clipping."""

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    decay_steps: int | None = None  # None: cosine over the whole run; 0: constant after warmup
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    # dtype of Adam's first moment (optax mu_dtype); null: the parameters' dtype. bfloat16 halves it.
    mu_dtype: DType | None = None

    _enums = {"mu_dtype": DType}

    def __post_init__(self) -> None:
        self._normalize()
        _check(self.learning_rate > 0, f"optimizer.learning_rate must be > 0, got {self.learning_rate}")
        _check(self.warmup_steps >= 0, f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(self.decay_steps is None or self.decay_steps >= 0,
               f"optimizer.decay_steps must be >= 0 or null, got {self.decay_steps}")
        _check(0 <= self.min_lr_ratio <= 1, f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _check(0 <= self.b1 < 1 and 0 <= self.b2 < 1,
               f"optimizer.b1 and optimizer.b2 must be in [0, 1), got {self.b1}, {self.b2}")
        _check(self.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        _check(self.max_grad_norm is None or self.max_grad_norm > 0,
               f"optimizer.max_grad_norm must be > 0 or null, got {self.max_grad_norm}")


# ----------------------------------------------------------------------------------------------
# Rollout engine


class RolloutEngineKind(enum.Enum):
    JAX = "jax"  # the built-in sampler (grpo_core.rl.sampler): any backend, multi-host
    SGLANG = "sglang"  # sglang-jax in the worker's process: single host, TPU v4+ (or CPU for tests)
    HTTP = "http"  # an OpenAI-compatible server (sglang-jax, SGLang, vLLM)

    @classmethod
    def _missing_(cls, value):
        return cls.SGLANG if value == "sglang-jax" else None


class HttpApi(enum.Enum):
    OPENAI = "openai"  # POST /v1/completions, token-id prompts, logprobs=1
    SGLANG = "sglang"  # POST /generate with input_ids (SGLang / sglang-jax): exact token ids back


@dataclasses.dataclass(frozen=True)
class RolloutConfig(_Config):
    """Which engine draws the completions, and its knobs (grpo_core.engines).

    Every wait on an engine has a time limit whose error names what was waited for: the engine
    or server start, one generate call (per HTTP request, with retries), one weight sync."""

    engine: RolloutEngineKind = RolloutEngineKind.JAX
    start_timeout_s: float = 900.0  # in-process engine start, or an owned server's start
    generate_timeout_s: float = 900.0  # one rollout (HTTP: one request)
    sync_timeout_s: float = 600.0  # one weight sync (in memory, or export + server reload)
    # old_logp rescored by the learner instead of the engine's own: null = wherever the sampler's
    # numbers can differ from the learner's (sglang and http engines: other kernels; the built-in
    # sampler in bfloat16: decoding with a KV cache rounds differently from the learner's forward).
    # The built-in sampler in float32 keeps its own: they agree to ~1e-6 (tests/test_learner.py).
    recompute_logprobs: bool | None = None
    # sglang-jax: the in-process engine, and the servers the http engine starts (server: sglang-jax)
    dtype: str | None = None  # engine weights/compute; null: the policy's compute dtype
    mem_fraction_static: float | None = None  # share of device memory for weights + KV cache
    max_total_tokens: int | None = None  # KV cache tokens; null: sglang's choice (CPU: a small default)
    context_length: int | None = None  # null: the model's max_position_embeddings
    max_running_requests: int | None = None  # null: one rollout batch (prompts x generations)
    disable_precompile: bool = False  # skip sglang's start-up compilation (faster start, slower first batches)
    attention_backend: str | None = None  # null: "native" on CPU, sglang's default elsewhere
    deterministic: bool = True  # seeded per-row sampling: a resumed run redraws the same completions
    # sglang-jax's overlap scheduler (CPU scheduling of the next batch during the current one).
    # Off by default: with it on, 3 of 6 sglang-jax 0.1.0rc0 servers started on CPU returned wrong
    # greedy tokens for the whole of their life (0 of 6 with it off, and 0 in process).
    overlap_schedule: bool = False
    # http
    url: str | None = None  # an already running server (not restarted here), e.g. http://10.0.0.2:30000
    api: HttpApi = HttpApi.OPENAI
    model_name: str | None = None  # the "model" of each request; null: the server's first /v1/models entry
    server: str | None = None  # "sglang-jax": start (and restart on each refresh) a server on 127.0.0.1
    server_args: tuple[str, ...] = ()  # extra command-line arguments of that server
    # or any server this run starts and restarts itself, e.g. ["vllm", "serve", "{model}", "--port",
    # "{port}"]: {model} (the exported folder), {port}, {host} and {python} are filled in
    server_command: tuple[str, ...] = ()
    reload_route: str | None = None  # POST {"model_path": folder} to reload weights (SGLang: /update_weights_from_disk)
    sync_every: int = 1  # http: steps between exports of the policy to the server
    export_dir: str | None = None  # http: where exports go (must be readable by the server); null: a temp folder
    request_retries: int = 2  # http: retries of a failed or timed-out request

    _enums = {"engine": RolloutEngineKind, "api": HttpApi}

    def __post_init__(self) -> None:
        self._normalize()
        for name in ("start_timeout_s", "generate_timeout_s", "sync_timeout_s"):
            _check(getattr(self, name) > 0, f"train.rollout.{name} must be > 0, got {getattr(self, name)}")
        _check(self.dtype in (None, "float32", "bfloat16"),
               f"train.rollout.dtype must be float32, bfloat16 or null, got {self.dtype!r}")
        _check(self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
               f"train.rollout.mem_fraction_static must be in (0, 1) or null, got {self.mem_fraction_static}")
        for name in ("max_total_tokens", "context_length", "max_running_requests"):
            v = getattr(self, name)
            _check(v is None or v >= 1, f"train.rollout.{name} must be >= 1 or null, got {v}")
        _check(self.sync_every >= 1, f"train.rollout.sync_every must be >= 1, got {self.sync_every}")
        _check(self.request_retries >= 0, f"train.rollout.request_retries must be >= 0, got {self.request_retries}")
        _check(self.server in (None, "sglang-jax"),
               f"train.rollout.server must be 'sglang-jax' or null (use url for another server), got {self.server!r}")
        _check(self.reload_route is None or self.reload_route.startswith("/"),
               f"train.rollout.reload_route must be a path like /update_weights_from_disk, got {self.reload_route!r}")
        if self.engine is RolloutEngineKind.HTTP:
            given = [n for n in ("url", "server", "server_command") if getattr(self, n)]
            _check(len(given) == 1,
                   "train.rollout.engine=http needs exactly one of train.rollout.url (a running server), "
                   "train.rollout.server=sglang-jax or train.rollout.server_command (a server started here); "
                   f"got {given or 'none'}")
            _check(not self.server_command or "{model}" in " ".join(self.server_command),
                   f"train.rollout.server_command must name the model folder as {{model}}, got {list(self.server_command)}")
            _check(self.url is None or self.reload_route is not None,
                   f"train.rollout.url={self.url!r} is a server this run cannot restart: set train.rollout.reload_route "
                   "(SGLang: /update_weights_from_disk) so it serves each exported policy, or use "
                   "train.rollout.server=sglang-jax")

    def learner_logprobs(self, compute_dtype: DType = DType.FLOAT32) -> bool:
        """Whether the learner rescores old_logp (see recompute_logprobs) for a policy computing in `compute_dtype`."""
        if self.recompute_logprobs is not None:
            return self.recompute_logprobs
        return self.engine is not RolloutEngineKind.JAX or compute_dtype is DType.BFLOAT16

    def result_fields(self) -> dict[str, Any] | None:
        """The fields that change what training computes (part of the training hash); None for
        the built-in engine, so runs that never set this section keep their hashes. Addresses,
        time limits and memory knobs change no result."""
        if self.engine is RolloutEngineKind.JAX:
            return None
        keep = ["engine", "dtype", "deterministic"]
        if self.engine is RolloutEngineKind.HTTP:
            keep += ["api", "sync_every"]
        return dict({k: v for k, v in self.to_dict().items() if k in keep}, learner_logprobs=self.learner_logprobs())


# ----------------------------------------------------------------------------------------------
# Device mesh


MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshShape(_Config):
    """Sizes of the mesh axes (grpo_core.runtime.mesh). data splits the batch only; fsdp splits the batch
    and every parameter's hidden dimension, optimizer state included (ZeRO-3); tensor splits
    attention heads, the MLP width and the vocabulary. -1 on one axis: every device the other
    axes leave, so the default runs on any number of devices."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def __post_init__(self) -> None:
        self._normalize()
        self._validate("train.mesh")

    def _validate(self, field: str) -> None:
        for name in MESH_AXES:
            v = getattr(self, name)
            _check(v == -1 or v >= 1, f"{field}.{name} must be a positive integer or -1 (the rest), got {v}")
        rest = [f"{field}.{n}" for n in MESH_AXES if getattr(self, n) == -1]
        _check(len(rest) <= 1, f"at most one mesh axis may be -1, got {' and '.join(rest)}")

    def sizes(self, num_devices: int, field: str = "train.mesh") -> tuple[int, ...]:
        """The axis sizes on `num_devices` devices, or ConfigError naming the field."""
        given = {n: getattr(self, n) for n in MESH_AXES}
        fixed = 1
        for v in given.values():
            fixed *= v if v > 0 else 1
        shown = ", ".join(f"{n}: {v}" for n, v in given.items())
        if -1 not in given.values():
            _check(fixed == num_devices, f"{field} {{{shown}}} needs {fixed} devices, but this run has {num_devices}; "
                                         f"set one axis to -1 to take the rest")
            return tuple(given.values())
        _check(num_devices % fixed == 0, f"{field} {{{shown}}}: {num_devices} devices do not divide into axes "
                                         f"of the fixed sizes (product {fixed})")
        return tuple(v if v > 0 else num_devices // fixed for v in given.values())


@dataclasses.dataclass(frozen=True)
class MeshConfig(MeshShape):
    """The `train.mesh` section: the learner's mesh (parameters, optimizer state, update batches)
    and, optionally, other layouts of the same devices for the rollout (the sampler's copy of
    the weights, its prompts and KV cache) and for the reference policy. null: the learner's
    mesh, and no second copy of the weights. Not part of the training hash: a run resumes on
    another mesh (Orbax restores onto the new shardings)."""

    rollout: MeshShape | None = None
    reference: MeshShape | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for role in ("rollout", "reference"):
            v = getattr(self, role)
            if isinstance(v, dict):
                known = list(MESH_AXES)
                _check(not set(v) - set(known), f"train.mesh.{role}: unknown field(s) {sorted(set(v) - set(known))}; "
                                                f"known: {known}")
                try:
                    v = MeshShape(**v)
                except ConfigError as exc:
                    raise ConfigError(str(exc).replace("train.mesh", f"train.mesh.{role}")) from None
            _check(v is None or isinstance(v, MeshShape),
                   f"train.mesh.{role} must be a mapping like {{data: 1, fsdp: -1, tensor: 1}} or null, got {v!r}")
            object.__setattr__(self, role, v)


# ----------------------------------------------------------------------------------------------
# Training run (engine level)


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Config):
    """Everything the engine needs for one training run, apart from the model and the task."""

    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    num_steps: int = 100
    seed: int = 0
    log_every: int = 1
    # Memory at real shapes (grpo_core.config.memory): the decoder layers' rematerialisation, and the size
    # of one vocabulary chunk's f32 logits when log-probs are computed (grpo_core.rl.logprobs). Neither
    # changes a result: not in the training hash.
    remat: RematPolicy = RematPolicy.AUTO
    logits_chunk_mib: int = 64

    _enums = {"remat": RematPolicy}

    def __post_init__(self) -> None:
        self._normalize()
        _check(self.num_steps >= 1, f"num_steps must be >= 1, got {self.num_steps}")
        _check(self.log_every >= 1, f"log_every must be >= 1, got {self.log_every}")
        _check(self.logits_chunk_mib >= 1, f"train.logits_chunk_mib must be >= 1, got {self.logits_chunk_mib}")
        _check(not self.sampling.greedy,
               "sampling.temperature must be > 0 for training: greedy decoding gives all "
               f"{self.grpo.num_generations} completions of a group the same reward, so every advantage is 0")

    def hash_fields(self) -> dict[str, Any]:
        """to_dict() less what changes no result (see RolloutConfig.result_fields)."""
        out = self.to_dict()
        rollout = self.rollout.result_fields()
        if rollout is None:
            del out["rollout"]
        else:
            out["rollout"] = rollout
        del out["mesh"]  # where arrays live changes results only within float tolerance
        del out["remat"], out["logits_chunk_mib"]  # how memory is spent: the same numbers
        # Accumulation sums exact per-token weights (algo.token_weights): the same update within
        # float tolerance, so it is hashed as 1, except under BNPO, which normalises per micro-batch.
        if self.grpo.loss_aggregation is not LossAggregation.BNPO:
            out["grpo"]["grad_accum_steps"] = 1
        if self.optimizer.mu_dtype is None:  # runs that never set it keep their hashes
            del out["optimizer"]["mu_dtype"]
        return out

    @property
    def memory_resolved(self) -> bool:
        """Whether remat and grad_accum_steps are chosen (not auto): what the learner needs."""
        return self.remat is not RematPolicy.AUTO and self.grpo.grad_accum_steps != "auto"


_SUBCONFIGS.update({
    ("TrainConfig", "grpo"): GRPOConfig,
    ("TrainConfig", "sampling"): SamplingConfig,
    ("TrainConfig", "optimizer"): OptimizerConfig,
    ("TrainConfig", "rollout"): RolloutConfig,
    ("TrainConfig", "mesh"): MeshConfig,
})


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict, returning a copy."""
    import copy

    import yaml

    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        _check(bool(sep) and bool(key), f"override {item!r} must look like key.path=value")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            _check(isinstance(node, dict), f"override {item!r}: {part!r} is not a section")
        node[parts[-1]] = value
    return out
