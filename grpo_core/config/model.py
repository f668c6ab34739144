"""The `model` section: where the starting policy comes from (a preset or a Hugging Face
checkpoint, its revision, the init seed, the tokenizer, LoRA adapters, field overrides) and the
architecture it resolves to (ModelConfig). JAX-free."""

from __future__ import annotations

import enum
import math
import re
from typing import Any

from grpo_core.config.fields import Section, Trust, check, field, section
from grpo_core.errors import ConfigError


class DType(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class ReferencePolicy(enum.Enum):
    """The KL reference of a run started from another run's policy (model.init_from)."""

    START = "start"  # the policy this run starts from, as TRL and verl define the reference
    BASE = "base"  # the model at model.path (or the preset), before any run trained it


@section(path="model")
class ModelConfig(Section):
    """A Qwen/Llama-style decoder. Field names follow Hugging Face configs one to one."""

    vocab_size: int = field(doc="Tokens in the vocabulary (the embedding and LM-head rows)", ge=1)
    hidden_size: int = field(doc="Width of the residual stream", ge=1)
    num_hidden_layers: int = field(doc="Decoder layers", ge=1)
    num_attention_heads: int = field(doc="Query heads", ge=1)
    num_key_value_heads: int = field(doc="Key/value heads (grouped-query attention)", ge=1)
    head_dim: int = field(doc="Width of one attention head", ge=1)
    intermediate_size: int = field(doc="Width of the MLP", ge=1)
    rms_norm_eps: float = field(1e-6, doc="RMSNorm epsilon", gt=0)
    rope_theta: float = field(1_000_000.0, doc="RoPE base frequency", gt=0)
    tie_word_embeddings: bool = field(
        True, doc="The LM head is the embedding matrix (Qwen's small models); false: a head of its own"
    )
    attention_bias: bool = field(False, doc="Qwen2: bias on q/k/v projections")
    qk_norm: bool = field(False, doc="Qwen3: RMSNorm over each head of q and k")
    max_position_embeddings: int = field(
        32768, doc="Longest sequence the model's positions are made for (prompt and completion)"
    )
    # Llama 3 "rope_scaling" = {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = field(
        None,
        doc="RoPE's scaling as config.json gives it (Llama 3's rope_type llama3 and its factors); empty: plain RoPE",
    )
    dtype: DType = field(DType.FLOAT32, doc="compute dtype")
    param_dtype: DType = field(DType.FLOAT32, doc="dtype the parameters are stored and updated in")

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # as config.json writes it: a mapping, hashable once sorted
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        super().__post_init__()

    def validate(self) -> None:
        check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
            f"model.num_key_value_heads ({self.num_key_value_heads})",
        )
        check(self.head_dim % 2 == 0, f"model.head_dim must be even for RoPE, got {self.head_dim}")

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


# The linears of a decoder layer (grpo_core.nn.model), as `re.search` sees them.
LAYER_LINEARS = tuple(
    f"model.layers.{m}"
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
)


@section(path="model.lora")
class LoraConfig(Section):
    """The `model.lora` section: rank, alpha (the update is scaled by alpha / rank) and the
    regex of target modules. dropout exists so that a PEFT-style config gets a clear answer."""

    rank: int = field(8, doc="Adapter rank r", ge=1)
    alpha: float = field(16.0, doc="The update x A B is scaled by alpha / rank", gt=0)
    target_modules: str = field(
        ".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*",
        doc=(
            "Regular expression searched in each decoder linear's path (model.layers.self_attn.q_proj, ..., "
            "model.layers.mlp.down_proj), e.g. .*(q_proj|v_proj).*"
        ),
        min_length=1,
        trust=Trust.SAFE,
    )
    # GRPO's ratio compares the policy with the log-probs it sampled with (no dropout); dropout
    # in the update alone would bias every ratio and the clipping with it.
    dropout: float = field(
        0.0,
        doc="Adapter dropout: only 0, since dropout in the update alone would bias GRPO's importance ratios",
        ge=0,
        le=0,
    )

    def validate(self) -> None:
        check(math.isfinite(self.alpha), f"model.lora.alpha must be finite, got {self.alpha}")
        self.select(LAYER_LINEARS)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def select(self, paths) -> list[str]:
        """The paths target_modules finds, or ConfigError listing those it could have found."""
        try:
            pattern = re.compile(self.target_modules)
        except re.error as exc:
            raise ConfigError(
                f"model.lora.target_modules {self.target_modules!r} is not a valid regular expression: {exc}"
            ) from None
        chosen = [p for p in paths if pattern.search(p)]
        check(
            bool(chosen),
            f"model.lora.target_modules {self.target_modules!r} matches none of the modules "
            f"{', '.join(p.rsplit('.', 1)[-1] for p in paths)} (it is searched in paths like {paths[0]})",
        )
        return chosen

    @classmethod
    def from_value(cls, value: Any) -> "LoraConfig":
        """From the run config's `model.lora`: a mapping, or true for the defaults."""
        if isinstance(value, LoraConfig):
            return value
        if value is True:
            value = {}
        check(
            isinstance(value, dict),
            f"model.lora must be a mapping like {{rank: 8, alpha: 16, target_modules: "
            f"'.*(q_proj|v_proj).*'}}, got {value!r}",
        )
        return cls.from_dict(value)


# The model section's own keys; any other key overrides a ModelConfig field of the preset.
MODEL_KEYS = ("preset", "seed", "tokenizer", "path", "revision", "lora", "init_from", "reference")
PATH_OVERRIDES = ("dtype", "param_dtype")  # the ModelConfig fields a checkpoint's config.json leaves open


@section(path="model")
class ModelSection(Section):
    """Where the starting policy comes from. Built by `from_value`, which normalises it so that
    equal models hash equally: the tokenizer filled in ('char' for a preset, 'auto' = the
    checkpoint's own with a path), no preset beside a path, empty optional keys dropped."""

    preset: str | None = field(None, doc="Model size and architecture when model.path is empty", trust=Trust.SAFE)
    path: str | None = field(
        None,
        doc="Start from a Hugging Face checkpoint (Qwen2, Qwen3, Llama): a Hub id like "
        "Qwen/Qwen3-0.6B, a folder or a gs:// folder. Empty: a preset with random weights",
        trust=Trust.READS,
    )
    revision: str | None = field(None, doc="Hub revision (branch, tag or commit) of model.path", trust=Trust.SAFE)
    seed: int = field(0, doc="Seed of the starting weights of a preset", ge=0)
    tokenizer: str = field(
        "char",
        doc="Empty: the checkpoint's own tokenizer with model.path, else 'char' (the "
        "built-in character tokenizer); or a Hugging Face tokenizer id/folder",
        trust=Trust.READS,
    )
    lora: LoraConfig | None = field(
        None,
        doc="LoRA instead of full fine-tuning: only the adapters train and are "
        "checkpointed, the KL reference is the base with adapters off, the "
        "export has them merged. Empty: full fine-tuning",
    )
    init_from: str | None = field(
        None,
        doc="Start from another run's policy: a run name under storage.root or a run's folder/URL, its newest "
        "checkpoint or export, or NAME@STEP for a given step; a pattern like nightly-* takes the last finished "
        "run whose name matches (names sort by date). Empty: start from model.path or the preset",
        trust=Trust.READS,
    )
    reference: ReferencePolicy = field(
        ReferencePolicy.START,
        doc="KL reference with model.init_from: start (the policy this run starts from) or base (the model at "
        "model.path or the preset, before any run trained it)",
    )
    overrides: dict = field(
        factory=dict,
        doc="ModelConfig fields over the preset's (Hugging Face names: "
        "hidden_size, dtype, ...); with model.path only dtype and param_dtype",
        trust=Trust.SAFE,
    )

    def validate(self) -> None:
        check(isinstance(self.overrides, dict), f"model overrides must be a mapping, got {self.overrides!r}")
        if self.init_from is not None:
            check(
                isinstance(self.init_from, str) and self.init_from.strip() != "",
                f"model.init_from must name a run (a name under storage.root, a folder or URL), got {self.init_from!r}",
            )
        check(
            self.reference is ReferencePolicy.START or self.init_from is not None,
            "model.reference: base differs from start only when model.init_from names a run to start from",
        )
        if self.path is None:
            check(self.revision is None, "model.revision applies to a Hugging Face id in model.path, which is not set")
            check(
                self.tokenizer != "auto", "model.tokenizer 'auto' means the tokenizer of model.path, which is not set"
            )

    @classmethod
    def from_value(cls, value: Any) -> "ModelSection":
        """From the run config's `model` mapping: its own keys, and ModelConfig overrides beside them."""
        if isinstance(value, ModelSection):
            return value
        check(isinstance(value, dict), f"model must be a mapping like {{preset: tiny}}, got {value!r}")
        given = {
            k: v
            for k, v in value.items()
            if not (k in ("path", "revision", "tokenizer", "lora", "init_from", "reference") and v in (None, ""))
        }
        if given.get("lora") is False:
            del given["lora"]
        own = {k: given.pop(k) for k in MODEL_KEYS if k in given}
        check(
            isinstance(own.get("seed", 0), int) and not isinstance(own.get("seed", 0), bool),
            f"model.seed must be an integer, got {own.get('seed')!r}",
        )
        if "lora" in own:
            own["lora"] = LoraConfig.from_value(own["lora"])
        if own.get("path") is not None:
            check(
                isinstance(own["path"], str),
                f"model.path must be a Hugging Face id, folder or URL, got {own['path']!r}",
            )
            own.pop("preset", None)
            own.setdefault("tokenizer", "auto")
        else:
            check(
                isinstance(own.get("tokenizer", "char"), str),
                f"model.tokenizer must be 'char' or a tokenizer id/folder, got {own.get('tokenizer')!r}",
            )
        return cls(**own, overrides=given)

    def to_dict(self) -> dict[str, Any]:
        """The section as written in config.json (and hashed): the keys given, overrides flat beside them."""
        out: dict[str, Any] = {} if self.preset is None else {"preset": self.preset}
        out.update(seed=self.seed, tokenizer=self.tokenizer)
        out.update({k: getattr(self, k) for k in ("path", "revision") if getattr(self, k) is not None})
        if self.lora is not None:
            out["lora"] = self.lora.to_dict()
        if self.init_from is not None:  # absent otherwise: the hashes of runs from before hold
            out.update(init_from=self.init_from, reference=self.reference.value)
        out.update(self.overrides)
        return out


# -- Hugging Face config.json, both ways ------------------------------------------------------

SUPPORTED = ("qwen2", "qwen3", "llama")


def model_config_from_hf(hf: dict[str, Any], where: str = "config.json", **overrides) -> ModelConfig:
    """Our ModelConfig from a Hugging Face config.json (transformers 4 or 5 layout)."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise ConfigError(f"{where}: model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
    rope = dict(hf.get("rope_parameters") or {})  # transformers 5 keeps rope_theta and scaling here
    theta = hf.get("rope_theta", rope.get("rope_theta", 10_000.0))
    scaling = hf.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} if rope else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    heads = hf["num_attention_heads"]
    fields = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=True if kind == "qwen2" else bool(hf.get("attention_bias", False)),
        qk_norm=kind == "qwen3",
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        rope_scaling=scaling or None,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def hf_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face architecture that holds exactly these features."""
    if cfg.qk_norm:
        return "qwen3"
    return "qwen2" if cfg.attention_bias else "llama"


_ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json for `cfg`, readable by transformers 4 and 5."""
    kind = hf_model_type(cfg)
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    out = {
        "architectures": [_ARCH[kind]],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, **(scaling or {})},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": cfg.param_dtype.value,
        "dtype": cfg.param_dtype.value,
    }
    if kind != "qwen2":
        out["attention_bias"] = cfg.attention_bias
    return out


# -- reward models: a sequence classifier's config.json ------------------------------------------

CLASSIFIER_SUFFIX = "ForSequenceClassification"


def classifier_labels(hf: dict[str, Any]) -> int:
    """The labels of a classifier's config.json as transformers counts them: id2label's entries,
    else num_labels, else transformers' default of 2."""
    if isinstance(hf.get("id2label"), dict) and hf["id2label"]:
        return len(hf["id2label"])
    return int(hf.get("num_labels", 2))


def classifier_config(hf: dict[str, Any], where: str = "config.json", **overrides) -> ModelConfig:
    """The trunk's ModelConfig of a Hugging Face *ForSequenceClassification config.json with one
    label (a reward model, as TRL loads one: AutoModelForSequenceClassification, num_labels=1), or
    ConfigError naming `where` and what it is instead."""
    arch = list(hf.get("architectures") or [])
    if not arch or not str(arch[0]).endswith(CLASSIFIER_SUFFIX):
        kind = hf.get("model_type", "qwen2")
        want = f"{_ARCH.get(kind, 'Qwen2ForCausalLM').removesuffix('ForCausalLM')}{CLASSIFIER_SUFFIX}"
        raise ConfigError(
            f"{where}: architectures {arch or 'not given'} is not a sequence classifier; a reward model is a "
            f"*{CLASSIFIER_SUFFIX} with one label (e.g. {want}, as AutoModelForSequenceClassification saves it)"
        )
    labels = classifier_labels(hf)
    if labels != 1:
        raise ConfigError(
            f"{where}: {arch[0]} has {labels} labels; a reward model scores with one (num_labels=1, as TRL's reward "
            "models are trained)"
        )
    # no LM head: its parameters are the trunk's (counted as a tied model's) and the score head's
    return model_config_from_hf(hf, where, **{"tie_word_embeddings": True, **overrides})


def hf_classifier_config(cfg: ModelConfig, pad_token_id: int) -> dict[str, Any]:
    """config.json of a one-label *ForSequenceClassification of `cfg`'s trunk (a reward model),
    readable by transformers 4 and 5: no LM head, so no tied embeddings."""
    out = hf_config(cfg)
    out.update(
        architectures=[_ARCH[hf_model_type(cfg)].replace("ForCausalLM", CLASSIFIER_SUFFIX)],
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        pad_token_id=int(pad_token_id),
        tie_word_embeddings=False,
    )
    return out


def num_adapter_params(mc, cfg: LoraConfig) -> int:
    """Adapter parameters of ModelConfig `mc` under cfg, without building anything: L * r * (in + out)
    per targeted linear (the readiness stage's memory budget)."""
    h, i = mc.hidden_size, mc.intermediate_size
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    dims = dict(zip(LAYER_LINEARS, [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]))
    return sum(mc.num_hidden_layers * cfg.rank * sum(dims[p]) for p in cfg.select(LAYER_LINEARS))
