"""Memory at real shapes: what a training run needs on each device, and the settings that fit it.

The readiness report and the training worker both call `plan`: the first to say whether a run
fits and what to change when it does not, the second to choose `train.remat: auto` and
`train.grpo.grad_accum_steps: auto` (the cheapest setting that fits). JAX is not imported here;
the few facts that need it (device memory, the process's own size) come from the callers.

What is alive at the peak, per device (train.mesh splits weights over fsdp x tensor and rows
over data x fsdp, heads and vocabulary over tensor):

    resident   params, optimizer moments, the KL reference, the process itself (CPU: its RSS)
    + the largest of the phases of a step:
      rollout    the KV cache of every row and the sampler's per-step logits
      backward   gradients, the activations each decoder layer keeps for the backward pass
                 (train.remat), one layer's recomputation, the chunked log-prob working set
      optimizer  gradients and the update's temporaries (AdamW runs leaf by leaf, ~2 gradient trees)

The per-token byte counts of the activations are those XLA's own buffer assignment gives the
learner's compiled step (`compiled.memory_analysis()`), fitted on the CPU backend across four
architectures, three dtype mixes and two completion lengths; tests/test_memory.py holds the
estimate to that measurement and to the measured peak RSS of real training processes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import sys
from typing import Any

from grpo_core.config import switches
from grpo_core.config.chunks import CHUNK_BUFFERS, num_chunks
from grpo_core.config.model import DType, ModelConfig, num_adapter_params
from grpo_core.config.train import RematPolicy, TrainConfig
from grpo_core.errors import ConfigError

GiB = 2**30
_BYTES = {DType.FLOAT32: 4, DType.BFLOAT16: 2}

# Cost of each choice relative to the backend's fastest, by which `plan` and the compiler's choice
# order them (the first that fits is taken). Measured update seconds at the median of 3 steps, one
# process per choice (bench.real_shapes; bench/gpu.sh on a GPU):
# - XLA:CPU, 2 cores, none / dots / full: tiny 0.07 / 0.06 / 0.07, small 2.19 / 2.07 / 2.56,
#   shape (a) 24.4 / 22.9 / 23.4: memory-bound, dots fastest.
# - H100, Qwen2.5-0.5B 8 x 8 x 512 in bf16, cuDNN attention: dots/1 0.39, full/1 0.41, dots/2
#   0.42, none/1 0.44, none/2 0.49: saving the matmuls' outputs alone (dots) beats keeping every
#   activation (none), which moves more bytes than recomputing norms, RoPE and the attention
#   kernel costs; each extra micro-batch added 8-11 %.
# - TPU: not measured yet; the compute-bound reading (full remat runs the forward again, ~1/3
#   more update compute, dots recomputes the cheap ops) orders none first.
# Each extra micro-batch reads every weight once more and launches every kernel again.
_REMAT_COST = {
    "cpu": {RematPolicy.DOTS: 0.97, RematPolicy.NONE: 1.0, RematPolicy.FULL: 1.1},
    "gpu": {RematPolicy.DOTS: 1.0, RematPolicy.FULL: 1.05, RematPolicy.NONE: 1.13},
    "tpu": {RematPolicy.NONE: 1.0, RematPolicy.DOTS: 1.1, RematPolicy.FULL: 1.33},
}
_ACCUM_COST = {"cpu": 0.05, "gpu": 0.1, "tpu": 0.05}
# A plan fits when its estimate is at most this share of the memory: the estimate is held to
# within 25% of measured peaks, and a host also runs the Prefect process and the OS.
HEADROOM = 0.9
# On CPU, what the process holds besides arrays once training starts: XLA's thread pools and
# allocator caches, the compiled programs and their compilation (measured: 230 MiB for the tiny
# preset and for shape (a) alike; it does not grow with the model, whose layers are one scanned body).
CPU_PROGRAMS_BYTES = 240 * 2**20


@dataclasses.dataclass(frozen=True)
class Layout:
    """How train.mesh splits the run over `devices`: (data, fsdp, tensor) sizes. On CPU every
    device shares the host's memory, so the caller counts the whole run on one (Layout())."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    @property
    def weights(self) -> int:  # parameters, gradients, moments, the reference
        return self.fsdp * self.tensor

    @property
    def rows(self) -> int:  # activations, KV cache, logits: rows over data x fsdp, heads/vocab over tensor
        return self.data * self.fsdp * self.tensor


@dataclasses.dataclass(frozen=True)
class RewardModelShape:
    """A reward model (rewards[].model) as the plan counts it: its trunk's config (in the run's
    dtype, grpo_core.config.model.classifier_config) and the batches it scores."""

    config: ModelConfig
    batch_size: int
    max_length: int
    name: str = ""

    def to_dict(self) -> dict[str, Any]:
        """As a readiness or AOT request carries it."""
        return {
            "model": self.config.to_dict(),
            "batch_size": self.batch_size,
            "max_length": self.max_length,
            "name": self.name,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RewardModelShape":
        if not isinstance(d, dict) or not isinstance(d.get("model"), dict):
            raise ConfigError(f"a reward model must be a mapping with 'model', 'batch_size', 'max_length', got {d!r}")
        return cls(
            ModelConfig.from_dict(d["model"]), int(d["batch_size"]), int(d["max_length"]), str(d.get("name", ""))
        )


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes per device by term, for one choice of remat and accumulation."""

    remat: RematPolicy
    grad_accum_steps: int
    chunk_mib: int
    terms: dict[str, int]
    phases: dict[str, int]  # rollout / backward / optimizer: the step's transient terms, summed
    resident: int

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def total(self) -> int:
        return self.resident + self.phases[self.peak_phase]

    @property
    def largest(self) -> str:
        return max(self.terms, key=self.terms.get)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The sizes that decide memory, read off the configs once."""

    prompts: int  # P per step
    rows: int  # B = P x G per step
    prompt_len: int  # Tp, the prompt bucket of data.max_prompt_tokens
    new_tokens: int  # N
    minibatches: int

    @classmethod
    def of(cls, train: TrainConfig, max_prompt_tokens: int) -> "Shapes":
        g, s = train.grpo, train.sampling
        tp = next((b for b in s.prompt_buckets if b >= max_prompt_tokens), max_prompt_tokens)
        # N: a completion's tokens, or an episode's (train.agent: its turns, tool results and glue,
        # which later turns' prompts hold too, so the rollout's cache holds Tp + N as well)
        return cls(g.prompts_per_step, g.batch_size, tp, train.completion_tokens, g.minibatches_per_rollout)


def update_bytes(model: ModelConfig, train: TrainConfig, max_prompt_tokens: int, **choices):
    """The estimate's total for each (remat, grad_accum_steps) candidate with the other `choices`
    (trainable, layout, backend, separate_reference) fixed: how the compiler's checks order the
    candidates and rule out the hopeless ones (grpo_core.rl.aot, grpo_core.rl.compiler_plan)."""
    return lambda remat, accum: (
        estimate(model, train, max_prompt_tokens, remat=remat, grad_accum_steps=accum, **choices).total
    )


def estimate(
    model: ModelConfig,
    train: TrainConfig,
    max_prompt_tokens: int,
    *,
    remat: RematPolicy,
    grad_accum_steps: int,
    trainable: int | None = None,
    layout: Layout = Layout(),
    backend: str = "cpu",
    runtime_bytes: int = 0,
    separate_reference: bool = False,
    reward_models: tuple[RewardModelShape, ...] = (),
) -> Estimate:
    """The bytes each device needs with these choices. `trainable`: the number of trained
    parameters under LoRA (f32 adapters; the base is frozen and is the reference); None: full
    fine-tuning. `runtime_bytes`: the process before any array exists (CPU: its RSS).
    `separate_reference`: the KL reference is weights of its own (a continual run's base,
    model.reference: base), a copy even under LoRA. `reward_models`: their weights stay resident
    (split as the reference's), and scoring a batch is a phase of its own, after the rollout."""
    sh = Shapes.of(train, max_prompt_tokens)
    m, g = model, train.grpo
    n, pb, cb = m.num_params(), _BYTES[m.param_dtype], _BYTES[m.dtype]
    lora = trainable is not None
    trained, tb = (trainable, 4) if lora else (n, pb)
    mu = _BYTES[train.optimizer.mu_dtype] if train.optimizer.mu_dtype is not None and not lora else tb
    w, r = layout.weights, layout.rows
    per = lambda x: int(math.ceil(x / w))
    rows = lambda x: int(math.ceil(x / r))
    micro_p = max(1, sh.prompts // (sh.minibatches * grad_accum_steps))
    micro_b = micro_p * g.num_generations
    head_tokens = micro_b * sh.new_tokens
    chunk_words = -(-m.vocab_size // num_chunks(m.vocab_size, head_tokens, train.logits_chunk_mib, backend))
    # XLA:CPU runs bfloat16 matmuls in f32: bf16 weights get f32 copies; f32 master weights get the
    # bf16 copies the compute dtype asks for
    upcast = (4 if pb == 2 else 2) * n if backend == "cpu" and m.dtype is DType.BFLOAT16 else 0
    terms = {
        "params": per(n * pb + (trained * tb if lora else 0)),
        "optimizer": per(trained * (mu + tb)),
        "reference": per(n * min(pb, cb)) if g.needs_reference and (separate_reference or not lora) else 0,
        "runtime": runtime_bytes,
        "programs": CPU_PROGRAMS_BYTES if backend == "cpu" else 0,
        "gradients": per(trained * tb),
        # the sum beside each micro-batch's, in f32 whatever the parameters' dtype (rl.learner.update)
        "grad_accumulator": per(trained * max(tb, 4)) if grad_accum_steps > 1 else 0,
        "optimizer_update": per(trained * tb),
        # split over the rows' devices (grpo_core.nn.model lays the tokens' hidden states out over
        # them), scaled per backend
        "activations": int(
            math.ceil(
                _ACT_SCALE.get(backend, 1.0)
                * _activations(
                    m, remat, micro_p, micro_b, sh.prompt_len, sh.new_tokens, _act_bytes(backend, cb), flash(backend, m)
                )
                / r
            )
        ),
        # a vocabulary chunk's logits and their gradient, and the tokens' hidden state and gradient
        "logprob_chunks": rows(CHUNK_BUFFERS * head_tokens * chunk_words * 4 + 2 * head_tokens * m.hidden_size * 4),
        "cpu_upcast": per(upcast),
        "kv_cache": rows(
            2
            * m.num_hidden_layers
            * sh.rows
            * (sh.prompt_len + sh.new_tokens)
            * m.num_key_value_heads
            * m.head_dim
            * cb
        ),
        "sampler_logits": rows(4 * sh.rows * m.vocab_size * 4),  # logits, log-softmax, exp, cumsum of one decode step
        # decode's copy of the layers' weights laid out per layer (grpo_core.nn.model.layers_apart,
        # the k/v and gate/up projections stacked on a GPU), where its layers run as straight code;
        # on CPU the f32 copies of bfloat16 weights (cpu_upcast) are made per layer instead
        "decode_layers": per(_layer_params(m) * pb) if switches.decode_unrolled(backend) and not upcast else 0,
    }
    t = terms
    phases = {
        "rollout": t["kv_cache"] + t["sampler_logits"] + t["decode_layers"] + t["cpu_upcast"],
        "backward": t["gradients"] + t["grad_accumulator"] + t["activations"] + t["logprob_chunks"] + t["cpu_upcast"],
        "optimizer": t["gradients"] + t["optimizer_update"],
    }
    if reward_models:  # absent otherwise: a run without one reports the terms it always did
        rm = [(r, _BYTES[r.config.param_dtype]) for r in reward_models]
        t["reward_models"] = sum(per(r.config.num_params() * b) for r, b in rm)
        # one batch of one model at a time: the largest; on CPU a bfloat16 model's f32 copy beside it
        t["reward_activations"] = max(
            rows(_ACT_SCALE.get(backend, 1.0) * reward_forward_bytes(r, backend)) for r, _ in rm
        )
        t["reward_upcast"] = max(per(4 * _layer_params(r.config)) if backend == "cpu" and b == 2 else 0 for r, b in rm)
        phases["rewards"] = t["reward_activations"] + t["reward_upcast"]
    resident = t["params"] + t["optimizer"] + t["reference"] + t["runtime"] + t["programs"] + t.get("reward_models", 0)
    return Estimate(remat, grad_accum_steps, train.logits_chunk_mib, terms, phases, resident)


def reward_forward_bytes(rm: RewardModelShape, backend: str = "cpu") -> int:
    """What scoring one batch of a reward model holds (grpo_core.nn.reward_model: a forward pass,
    nothing kept for a backward one) at batch_size x max_length tokens: the larger of the
    attention's working set (the residual, q/k/v, and its scores and softmax in f32, or a
    log-sum-exp per query under a fused kernel) and the MLP's; on CPU one layer's weights copied
    out of the stacked arrays in f32 beside them."""
    m = rm.config
    tokens, heads = rm.batch_size * rm.max_length, m.num_attention_heads
    ab = _act_bytes(backend, _BYTES[m.dtype])
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    k = _FORWARD
    scores = heads * rm.batch_size * (rm.max_length if flash(backend, m) else rm.max_length**2)
    attention = tokens * (k["e"] * m.hidden_size + k["qkv"] * (q + kv)) * ab + scores * k["score"]
    mlp = tokens * (2 * m.hidden_size + 3 * m.intermediate_size) * ab
    layer = 4 * _layer_params(m) // m.num_hidden_layers if backend == "cpu" else 0
    return int(max(attention, mlp) + layer)


def _layer_params(m: ModelConfig) -> int:
    """The decoder layers' parameters: all but the embedding, the untied head and the final norm."""
    return m.num_params() - m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2) - m.hidden_size


def flash(backend: str, m: ModelConfig) -> bool:
    """Whether the learner's attention is a fused kernel that never holds the scores (cuDNN's on a
    GPU for a bfloat16 model, unless GRPO_ATTENTION=xla: grpo_core.nn.model.attention_impl)."""
    return backend == "gpu" and m.dtype is DType.BFLOAT16 and switches.attention() != "xla"


def _activations(
    m: ModelConfig, remat: RematPolicy, p: int, b: int, tp: int, n: int, act_bytes: int, flash: bool = False
) -> int:
    """What the decoder layers keep for the backward pass of one micro-batch (p prompts, b rows),
    plus the working set of the one layer whose backward runs. Prompt tokens run once per group (model.GroupedInputs):
    p*tp + b*n tokens; attention scores are b*n*(tp+n) + p*tp*tp per head, or under a fused
    (`flash`) kernel one log-sum-exp per query. `act_bytes`: bytes of an activation element
    (XLA:CPU keeps bfloat16 work in f32)."""
    e, q, kv, i, L = (  # noqa: N806  (L: layers, as in the formula)
        m.hidden_size,
        m.num_attention_heads * m.head_dim,
        m.num_key_value_heads * m.head_dim,
        m.intermediate_size,
        m.num_hidden_layers,
    )
    tokens = p * tp + b * n
    scores = m.num_attention_heads * ((b * n + p * tp) if flash else (b * n * (tp + n) + p * tp * tp))
    k = _PER_TOKEN
    # attention scores and their softmax are f32 on every backend (model.attend): their
    # bytes do not scale with the compute dtype
    every = tokens * (k["e"] * e + k["qkv"] * (q + kv) + k["i"] * i) * act_bytes + scores * k["score"]
    kept = {
        RematPolicy.NONE: every,  # every intermediate: norms, q/k/v, RoPE, attention probabilities, the MLP's
        RematPolicy.DOTS: tokens * (q + 2 * kv + 2 * e + 2 * i) * act_bytes,  # the weight matmuls' outputs
        RematPolicy.FULL: tokens * e * act_bytes,  # the layer's input
    }[remat]
    # + the working set of the layer whose backward runs: what it recomputes (under dots, all but
    # the matmul outputs it kept) beside its gradients' temporaries
    return int(L * kept + (every - kept if remat is RematPolicy.DOTS else every))


def _act_bytes(backend: str, compute_bytes: int) -> int:
    """Bytes of an activation element: XLA:CPU and XLA:TPU keep bfloat16 work in f32 between
    fusions (their buffer assignments show f32 intermediates); GPUs as computed."""
    return 4 if backend in ("cpu", "tpu") else compute_bytes


# What XLA:TPU's buffer assignment holds against the CPU-fitted per-token counts (it fuses more of
# each layer than XLA:CPU), fitted on bench.aot's candidates (grpo_core.rl.aot: the update's chip
# peak) with the activations laid out over the rows: qwen2.5-0.5b at 8 x 8 x 512 tokens, dots/1,
# 7.4 GiB a chip on v5e:2x2 and 3.9 on v5p:2x2x2; on bench.aot's 23 candidates of three Qwen models
# on four topologies, 0.88-1.06x XLA's figure (docs/benchmarks.md, "The TPU check")
_ACT_SCALE = {"tpu": 0.57}


# Elements per token and layer that a decoder layer keeps without remat (e hidden, q+kv the
# query and kv projections' widths, i the MLP width), and bytes per attention score (f32), as
# fitted to XLA's buffer assignment of the learner's step (module doc).
_PER_TOKEN = {"e": 6.0, "qkv": 4.3, "i": 5.6, "score": 10.0}


# Elements per token a reward model's attention holds at its peak (the residual, q/k/v) and bytes
# per attention score (scores and softmax in f32): fitted to XLA's buffer assignment of the scoring
# program (grpo_core.nn.reward_model, compiled.memory_analysis()), as _PER_TOKEN is to the update's.
# On XLA:CPU (tiny, small and Qwen2.5-0.5B's layers in f32 and bf16, 256-2048 tokens a batch):
# 0.99-1.04x its temporaries from 2048 tokens, up to 1.4x below (bench.real_shapes measures the process).
_FORWARD = {"e": 1.3, "qkv": 0.8, "score": 12.0}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The chosen settings, their estimate, and what the devices have."""

    estimate: Estimate
    available: int | None  # bytes per device; None: unknown
    auto: tuple[str, ...]  # the fields that were auto and are chosen here

    @property
    def fits(self) -> bool | None:
        return None if self.available is None else self.estimate.total <= HEADROOM * self.available

    def report(self) -> dict[str, Any]:
        """The readiness report's `memory` section."""
        e = self.estimate
        return {
            "terms_bytes": dict(e.terms),
            "phases_bytes": dict(e.phases),
            "peak_phase": e.peak_phase,
            "total_bytes": e.total,
            "total_gib": round(e.total / GiB, 3),
            "available_bytes": self.available,
            "fits": self.fits,
            "largest": e.largest,
            "remat": e.remat.value,
            "grad_accum_steps": e.grad_accum_steps,
            "logits_chunk_mib": e.chunk_mib,
            "chosen": list(self.auto),
        }

    def describe(self) -> str:
        e = self.estimate
        have = "unknown" if self.available is None else f"{self.available / GiB:.2f} GiB (plans use {HEADROOM:.0%})"
        chosen = f" (auto: {', '.join(self.auto)})" if self.auto else ""
        return (
            f"needs ~{e.total / GiB:.2f} GiB of {have} at its peak ({e.peak_phase}) with train.remat={e.remat.value}, "
            f"train.grpo.grad_accum_steps={e.grad_accum_steps}{chosen}"
        )

    def lever(self, train: TrainConfig) -> str:
        """What to change when it does not fit, naming the term that dominates."""
        e, g, s = self.estimate, train.grpo, train.sampling
        need, have = e.total / GiB, (self.available or 0) / GiB
        phase_terms = {
            "rollout": ("kv_cache", "sampler_logits"),
            "backward": ("activations", "logprob_chunks"),
            "optimizer": ("gradients",),
            "rewards": ("reward_activations", "reward_upcast"),
        }[e.peak_phase]
        resident = ("params", "optimizer", "reference") + (("reward_models",) if "reward_models" in e.terms else ())
        big = max(phase_terms + resident, key=e.terms.get)
        head = f"needs {need:.2f} GiB, devices have {have:.2f} GiB; largest term {big}: "
        weights = (
            "use a smaller model, bfloat16 parameters (model.param_dtype=bfloat16), LoRA (model.lora: "
            "gradients and optimizer state for the adapters only), or shard over more devices "
            "(train.mesh: fsdp and tensor split the weights)"
        )
        return head + {
            "kv_cache": f"lower train.grpo.prompts_per_step (now {g.prompts_per_step}), train.sampling.max_new_tokens "
            f"(now {s.max_new_tokens}) or data.max_prompt_tokens",
            "sampler_logits": f"lower train.grpo.prompts_per_step (now {g.prompts_per_step})",
            "activations": "set train.remat=full and train.grpo.grad_accum_steps=auto (fewer rows per micro-batch), "
            f"or lower train.sampling.max_new_tokens (now {s.max_new_tokens})",
            "logprob_chunks": f"lower train.logits_chunk_mib (now {train.logits_chunk_mib})",
            "reference": "set train.grpo.beta=0 (no reference copy), use LoRA (model.lora: the base is the "
            "reference), or use a smaller model",
            "optimizer": "set train.optimizer.mu_dtype=bfloat16, or " + weights,
            "reward_activations": "lower rewards[].batch_size or rewards[].max_length of the reward model",
            "reward_upcast": "a float32 run (model.dtype): XLA:CPU computes a bfloat16 reward model in float32",
            "reward_models": "use a smaller reward model, or shard over more devices (train.mesh: fsdp and tensor "
            "split the reward model as they split the reference)",
        }.get(big, weights)


def candidates(train: TrainConfig, backend: str = "cpu") -> list[tuple[RematPolicy, int]]:
    """The (remat, accumulation) choices the config leaves open, cheapest first on `backend`."""
    kind = backend if backend in _REMAT_COST else "tpu"  # another accelerator: the compute-bound order
    cost, per_accum = _REMAT_COST[kind], _ACCUM_COST[kind]
    remats = list(cost) if train.remat is RematPolicy.AUTO else [train.remat]
    g = train.grpo
    accums = g.accumulation_choices() if g.grad_accum_steps == "auto" else [g.grad_accum_steps]
    out = [(r, a) for r in remats for a in accums]
    return sorted(out, key=lambda c: (cost[c[0]] * (1 + per_accum * (c[1] - 1)), c[1]))


def plan(model: ModelConfig, train: TrainConfig, max_prompt_tokens: int, available: int | None, **kw: Any) -> Plan:
    """The cheapest (remat, accumulation) that fits `available` bytes per device; when nothing
    does, the one that needs least (its Plan says it does not fit). With memory unknown, the
    cheapest. `kw`: estimate's trainable, layout, backend, runtime_bytes, separate_reference,
    reward_models."""
    auto = tuple(
        f
        for f, is_auto in (
            ("train.remat", train.remat is RematPolicy.AUTO),
            ("train.grpo.grad_accum_steps", train.grpo.grad_accum_steps == "auto"),
        )
        if is_auto
    )
    ests = [
        estimate(model, train, max_prompt_tokens, remat=r, grad_accum_steps=a, **kw)
        for r, a in candidates(train, kw.get("backend", "cpu"))
    ]
    if available is not None:
        fitting = [e for e in ests if e.total <= HEADROOM * available]
        return Plan(fitting[0] if fitting else min(ests, key=lambda e: e.total), available, auto)
    return Plan(ests[0], None, auto)


def resolve(train: TrainConfig, p: Plan) -> TrainConfig:
    """`train` with remat and grad_accum_steps as the plan chose them."""
    return train.replace(remat=p.estimate.remat, grpo=train.grpo.replace(grad_accum_steps=p.estimate.grad_accum_steps))


def plan_on(
    model: ModelConfig,
    train: TrainConfig,
    max_prompt_tokens: int,
    facts: dict[str, Any],
    lora=None,
    separate_reference: bool = False,
    reward_models: tuple[RewardModelShape, ...] = (),
) -> Plan:
    """`plan` for the devices `device_facts` (or the readiness report) describes: on CPU the run
    counts once against the host (its devices share the memory), elsewhere per device as
    train.mesh splits it. `lora`: a grpo_core.nn.lora.LoraConfig (only the adapters train).
    `reward_models`: the run's (rewards[].model)."""
    trainable = None
    if lora is not None:
        trainable = num_adapter_params(model, lora)
    layout = Layout()
    if facts["backend"] != "cpu":
        try:
            layout = Layout(*train.mesh.sizes(facts["devices"]))
        except ConfigError:  # the mesh check reports it; count everything on one device
            pass
    return plan(
        model,
        train,
        max_prompt_tokens,
        facts["available"],
        trainable=trainable,
        layout=layout,
        backend=facts["backend"],
        runtime_bytes=facts.get("runtime", 0),
        separate_reference=separate_reference,
        reward_models=tuple(reward_models),
    )


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failure of XLA (RESOURCE_EXHAUSTED on a device) or of the host."""
    text = f"{type(exc).__name__}: {exc}"
    return isinstance(exc, MemoryError) or "RESOURCE_EXHAUSTED" in text or "Out of memory" in text


def peak_rss_bytes() -> int:
    """This process's peak resident set: /proc's VmHWM, the high-water mark of its own address space.
    (getrusage's ru_maxrss survives execve: a worker started by a large process would report that
    process's peak.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_bytes() -> dict[str, int]:
    """This process's peak resident set, and on accelerators the first device's peak use."""
    out = {"peak_rss_bytes": peak_rss_bytes()}
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            dev = jax.local_devices()[0]
            if dev.platform != "cpu":
                out["peak_device_bytes"] = int((dev.memory_stats() or {}).get("peak_bytes_in_use", 0))
        except Exception:  # noqa: BLE001 - a statistic, never a reason to fail a step
            pass
    return out


# -- the facts that need the backend (imported by the worker and the readiness process) -----------


def host_memory_bytes(pid: int | str = "self") -> int:
    """The memory process `pid` may use on the host: physical RAM, or its cgroup's limit if lower
    (cgroup v2 memory.max or v1 memory.limit_in_bytes, along the process's own cgroup path)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _cgroup_limit_files(pid):
        try:
            raw = open(path).read().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw))
    return total


def _cgroup_limit_files(pid: int | str) -> list[str]:
    try:
        lines = open(f"/proc/{pid}/cgroup").read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:  # "4:memory:/a/b" (v1) or "0::/a/b" (v2)
        _, controllers, path = line.split(":", 2)
        path = path.strip("/")
        if controllers == "":
            for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                out.append(os.path.join(base, path, "memory.max"))
        elif "memory" in controllers.split(","):
            out.append(os.path.join("/sys/fs/cgroup/memory", path, "memory.limit_in_bytes"))
    return out


def rss_bytes() -> int:
    """This process's resident set now (Linux /proc; 0 where unreadable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def device_facts(jax_module=None) -> dict[str, Any]:
    """backend, bytes per device (CPU: the host's, shared by every CPU device), and the runtime
    term (CPU: this process's RSS before the run's arrays exist)."""
    import jax  # only the worker and readiness processes call this: the plan itself is JAX-free

    devices = jax.devices()
    backend = devices[0].platform
    if backend == "cpu":
        return {"backend": backend, "available": host_memory_bytes(), "runtime": rss_bytes(), "devices": len(devices)}
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return {
        "backend": backend,
        "available": None if limit is None else int(limit),
        "runtime": 0,
        "devices": len(devices),
    }
