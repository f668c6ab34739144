"""The pipeline's parameters as typed models: what Prefect shows as the run form in the UI and
checks before a run starts (types, bounds, choices), built from the config dataclasses of
grpo_core so that types and defaults live in one place. Descriptions and bounds are listed here
by dotted field path; cross-field rules (e.g. prompts_per_step divisible by the micro-batches)
are checked by RunConfig when the run starts, with messages that name the field.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model

from grpo_core.config.train import _SUBCONFIGS, TrainConfig
from grpo_core.data.prepare import DataConfig
from grpo_core.nn.lora import LoraConfig
from grpo_core.config.presets import PRESETS
from grpo_core.config.run import EvalConfig, PipelineConfig, RunConfig

DOCS: dict[str, tuple[str, dict[str, Any]]] = {
    "run_name": ("Folder of this run under storage.root. Empty: named by the preset and the config hash, "
                 "so the same config resumes its own run", {}),
    "storage.root": ("Where runs live: a local folder, gs://bucket/prefix or memory://...", {"min_length": 1}),
    "model.path": ("Start from a Hugging Face checkpoint (Qwen2, Qwen3, Llama): a Hub id like Qwen/Qwen3-0.6B, "
                   "a folder or a gs:// folder. Empty: a preset with random weights", {}),
    "model.revision": ("Hub revision (branch, tag or commit) of model.path", {}),
    "model.preset": ("Model size and architecture when model.path is empty", {}),
    "model.seed": ("Seed of the starting weights of a preset", {"ge": 0}),
    "model.lora": ("LoRA instead of full fine-tuning: only the adapters train and are checkpointed, the KL "
                   "reference is the base with adapters off, the export has them merged. Empty: full fine-tuning", {}),
    "model.lora.rank": ("Adapter rank r", {"ge": 1}),
    "model.lora.dropout": ("Adapter dropout: only 0, since dropout in the update alone would bias GRPO's "
                           "importance ratios", {"ge": 0, "le": 0}),
    "model.lora.alpha": ("The update x A B is scaled by alpha / rank", {"gt": 0}),
    "model.lora.target_modules": ("Regular expression searched in each decoder linear's path "
                                  "(model.layers.self_attn.q_proj, ..., model.layers.mlp.down_proj), e.g. "
                                  ".*(q_proj|v_proj).*", {"min_length": 1}),
    "model.tokenizer": ("Empty: the checkpoint's own tokenizer with model.path, else 'char' (the built-in "
                        "character tokenizer); or a Hugging Face tokenizer id/folder", {}),
    "rewards": ("Reward functions: a built-in name (char_match, exact_match, math_answer, think_format, "
                "integer_answer) or path/to/file.py:function "
                "or module:function, with their weights (0: reported, not optimised)", {"min_length": 1}),
    "data.source": ("'synthetic', a .jsonl/.json/.parquet/.csv path or gs:// URL, or a Hugging Face dataset "
                    "id or folder", {"min_length": 1}),
    "data.subset": ("Hugging Face dataset config (subset) name", {}),
    "data.split": ("Split to train on", {}),
    "data.eval_split": ("Split to evaluate on; empty: hold out data.eval_fraction of the training rows", {}),
    "data.format": ("How rows are read: gsm8k (question, answer ending in '#### 42'), verl (prompt messages, "
                    "reward_model.ground_truth), plain, or auto (detect gsm8k/verl from the first row)", {}),
    "data.prompt_column": ("Column holding the prompt", {}),
    "data.rename": ("Column renames applied first: {source column: name the rewards see}", {}),
    "data.template": ("Prompt template over the row's columns, e.g. 'Q: {question}\\nA:'", {}),
    "data.chat": ("Render prompts with the tokenizer's chat template", {}),
    "data.system_prompt": ("System message for chat prompts", {}),
    "data.max_prompt_tokens": ("Prompts longer than this are dropped (and counted)", {"ge": 1}),
    "data.max_rows": ("Use at most this many rows", {"ge": 2}),
    "data.eval_fraction": ("Fraction of rows held out for evaluation", {"ge": 0, "le": 0.9}),
    "data.eval_rows": ("At most this many evaluation rows", {"ge": 1}),
    "data.seed": ("Shuffle seed for the split and the prompt order", {"ge": 0}),
    "data.synthetic": ("The synthetic task: alphabet, min_len, max_len, seed", {}),
    "data.synthetic_rows": ("Training rows generated for the synthetic task", {"ge": 1}),
    "train.num_steps": ("GRPO steps in the whole run", {"ge": 1}),
    "train.seed": ("Seed of every step's sampling", {"ge": 0}),
    "train.log_every": ("Report metrics every N steps", {"ge": 1}),
    "train.remat": ("What each decoder layer keeps for the backward pass: none (all, fastest), dots (the matmul "
                    "outputs), full (its input only); auto: the fastest that fits the devices", {}),
    "train.logits_chunk_mib": ("Size of one vocabulary chunk's f32 logits when log-probs are computed (MiB)",
                               {"ge": 1}),
    "train.grpo.num_generations": ("Completions per prompt (G)", {"ge": 2}),
    "train.grpo.prompts_per_step": ("Prompts per step (P)", {"ge": 1}),
    "train.grpo.advantage": ("grpo: (r - mean)/std; dr_grpo: r - mean; rloo: leave-one-out", {}),
    "train.grpo.scale_rewards": ("Divide advantages by the std of the group, the batch, or not at all", {}),
    "train.grpo.advantage_eps": ("Added to the std", {"gt": 0}),
    "train.grpo.epsilon_low": ("Lower clip range", {"ge": 0, "lt": 1}),
    "train.grpo.epsilon_high": ("Upper clip range (DAPO clip-higher: 0.28)", {"ge": 0}),
    "train.grpo.dual_clip": ("Dual-clip constant (> 1); empty: off", {"gt": 1}),
    "train.grpo.ratio_level": ("Importance ratio per token (GRPO) or per sequence (GSPO)", {}),
    "train.grpo.loss_aggregation": ("token_mean (DAPO), seq_mean_token_mean (GRPO), seq_mean_token_sum_norm "
                                    "(Dr. GRPO), bnpo", {}),
    "train.grpo.beta": ("KL coefficient; 0: no reference model", {"ge": 0}),
    "train.grpo.kl_estimator": ("KL estimator", {}),
    "train.grpo.num_iterations": ("Passes over each rollout batch", {"ge": 1}),
    "train.grpo.minibatches_per_rollout": ("Optimizer updates per pass", {"ge": 1}),
    "train.grpo.grad_accum_steps": ("Micro-batches summed into one update; auto: the fewest that fit the devices",
                                    {"ge": 1}),
    "train.grpo.mask_truncated_completions": ("No loss on completions cut at max_new_tokens", {}),
    "train.grpo.dynamic_sampling": ("Drop groups whose rewards are all equal and sample again", {}),
    "train.grpo.max_sampling_rounds": ("Bound on sampling rounds per step", {"ge": 1}),
    "train.sampling.max_new_tokens": ("Longest completion", {"ge": 1}),
    "train.sampling.temperature": ("Sampling temperature for training rollouts", {"gt": 0}),
    "train.sampling.top_k": ("Top-k (0: off)", {"ge": 0}),
    "train.sampling.top_p": ("Top-p (1: off)", {"gt": 0, "le": 1}),
    "train.sampling.prompt_buckets": ("Prompt lengths to pad to (one compiled program each)", {"min_length": 1}),
    "train.sampling.ignore_eos": ("Always generate max_new_tokens (benchmarks)", {}),
    "train.optimizer.learning_rate": ("Peak learning rate (AdamW)", {"gt": 0}),
    "train.optimizer.warmup_steps": ("Linear warmup steps", {"ge": 0}),
    "train.optimizer.decay_steps": ("Cosine decay steps; empty: the whole run, 0: constant", {"ge": 0}),
    "train.optimizer.min_lr_ratio": ("Final learning rate as a fraction of the peak", {"ge": 0, "le": 1}),
    "train.optimizer.b1": ("Adam beta1", {"ge": 0, "lt": 1}),
    "train.optimizer.b2": ("Adam beta2", {"ge": 0, "lt": 1}),
    "train.optimizer.eps": ("Adam epsilon", {"gt": 0}),
    "train.optimizer.weight_decay": ("Decoupled weight decay", {"ge": 0}),
    "train.optimizer.max_grad_norm": ("Global-norm gradient clipping; empty: off", {"gt": 0}),
    "train.optimizer.mu_dtype": ("dtype of Adam's first moment (bfloat16 halves it); empty: the parameters'", {}),
    "train.rollout.engine": ("Rollout engine: jax (built-in sampler, multi-host), sglang (sglang-jax in the worker's "
                             "process: one host, TPU v4+; the worker runs in .venv-sglang) or http (an "
                             "OpenAI-compatible server)", {}),
    "train.rollout.start_timeout_s": ("Limit on an engine's or a server's start, seconds", {"gt": 0}),
    "train.rollout.generate_timeout_s": ("Limit on one rollout (http: one request), seconds", {"gt": 0}),
    "train.rollout.sync_timeout_s": ("Limit on one weight sync (http: export + reload), seconds", {"gt": 0}),
    "train.rollout.recompute_logprobs": ("old_logp rescored by the learner instead of the engine's; empty: sglang, http and "
                                         "bfloat16 yes, the built-in sampler in float32 no", {}),
    "train.rollout.dtype": ("sglang/http engine dtype (float32, bfloat16); empty: the policy's", {}),
    "train.rollout.mem_fraction_static": ("sglang: share of device memory for its weights and KV cache",
                                          {"gt": 0, "lt": 1}),
    "train.rollout.max_total_tokens": ("sglang: KV-cache tokens; empty: sglang's choice", {"ge": 1}),
    "train.rollout.context_length": ("sglang: longest prompt + completion; empty: the model's", {"ge": 1}),
    "train.rollout.max_running_requests": ("sglang: concurrent rows; empty: one rollout batch", {"ge": 1}),
    "train.rollout.disable_precompile": ("sglang: skip start-up compilation (faster start, slower first "
                                         "rollouts)", {}),
    "train.rollout.url": ("http: a running server (with train.rollout.reload_route)", {}),
    "train.rollout.server": ("http: 'sglang-jax' starts and restarts a server on 127.0.0.1 with each export", {}),
    "train.rollout.sync_every": ("http: steps between exports of the policy to the server", {"ge": 1}),
    "train.mesh.data": ("Mesh axis that splits batches only; -1: the devices the other axes leave", {"ge": -1}),
    "train.mesh.fsdp": ("Mesh axis that splits batches and every parameter and optimizer moment (ZeRO-3); "
                        "-1: the devices the other axes leave", {"ge": -1}),
    "train.mesh.tensor": ("Mesh axis that splits heads, MLP width and vocabulary (Megatron-style); -1: the rest",
                          {"ge": -1}),
    "train.mesh.rollout": ("Another layout of the same devices for the sampler ({data, fsdp, tensor}); empty: the "
                           "learner's mesh and no second copy of the weights", {}),
    "train.mesh.reference": ("Another layout of the same devices for the KL reference; empty: the learner's", {}),
    "eval.rewards": ("Rewards evaluation reports; empty: the training rewards", {}),
    "eval.accuracy_reward": ("The eval reward whose greedy mean is 'accuracy' and which decides pass@k", {}),
    "eval.num_samples": ("Samples per prompt for pass@k (1: greedy only)", {"ge": 1}),
    "eval.temperature": ("Temperature of the pass@k samples", {"gt": 0}),
    "eval.batch_size": ("Prompts per evaluation batch", {"ge": 1}),
    "pipeline.epochs": ("Training stages; train.num_steps is split evenly across them", {"ge": 1}),
    "pipeline.checkpoint_every": ("Steps between checkpoints", {"ge": 1}),
    "pipeline.require_tpu": ("Fail readiness unless the worker sees a TPU", {}),
    "pipeline.retries": ("Task retries of crashes, preemption and storage errors", {"ge": 0}),
    "pipeline.retry_delay_s": ("Seconds between task retries", {"ge": 0}),
    "pipeline.flow_retries": ("Retries of the whole flow run", {"ge": 0}),
    "pipeline.train_timeout_s": ("Hard limit per training-epoch attempt, seconds", {"gt": 0}),
    "pipeline.eval_timeout_s": ("Hard limit per evaluation attempt, seconds", {"gt": 0}),
    "pipeline.check_timeout_s": ("Hard limit for the device checks, seconds", {"gt": 0}),
    "pipeline.export": ("Write the final policy as a Hugging Face folder (safetensors, config, tokenizer) "
                        "under export/{step}/", {}),
    "pipeline.export_timeout_s": ("Hard limit for the export, seconds", {"gt": 0}),
    "pipeline.worker_python": ("Interpreter of the training workers; empty: this one, or .venv-sglang's "
                               "with train.rollout.engine=sglang", {}),
    "pipeline.launcher": ("How workers start: one process here, N processes on this machine, a Ray cluster "
                          "or a TPU VM slice", {}),
    "pipeline.launcher.kind": ("local (one process), multiprocess (N processes on 127.0.0.1 with CPU devices: "
                               "multi-host code on one machine), ray (one task per host), tpu-vm (gcloud ssh "
                               "--worker=all)", {}),
    "pipeline.launcher.num_processes": ("multiprocess: processes on this machine; ray: hosts, one task each",
                                        {"ge": 1}),
    "pipeline.launcher.devices_per_process": ("multiprocess: CPU devices of each process", {"ge": 1}),
    "pipeline.launcher.coordinator_port": ("Port of the jax.distributed coordinator (process 0); 0: a free port "
                                           "(multiprocess) or 8476 (ray)", {"ge": 0, "le": 65535}),
    "pipeline.launcher.address": ("ray: the cluster address as ray.init takes it (auto, ray://head:10001)", {}),
    "pipeline.launcher.resources_per_host": ("ray: each host task's resources, e.g. {TPU: 4}; empty: {CPU: 1}", {}),
    "pipeline.launcher.placement_strategy": ("ray: STRICT_SPREAD puts one task on each node", {}),
    "pipeline.launcher.tpu_name": ("tpu-vm: the TPU VM (slice) name", {}),
    "pipeline.launcher.zone": ("tpu-vm: its zone", {}),
    "pipeline.launcher.project": ("tpu-vm: its project; empty: gcloud's configured one", {}),
    "pipeline.launcher.workdir": ("tpu-vm: the project checkout on every host", {}),
    "pipeline.launcher.python": ("tpu-vm: the interpreter on every host, relative to workdir", {}),
    "pipeline.launcher.init_timeout_s": ("Seconds every process has to join the run", {"ge": 1}),
    "pipeline.launcher.heartbeat_timeout_s": ("Seconds a silent process is tolerated before the others fail",
                                              {"ge": 1}),
}

_DEFAULTS = RunConfig.from_dict({}).to_dict()


class RewardParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    function: str = Field(min_length=1, description="built-in name, path/to/file.py:function or module:function")
    weight: float = Field(1.0, description="weight in the total reward (0: reported, not optimised)")


def _annotation(hint: Any, enum_cls: type[enum.Enum] | None, bounds: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The pydantic type of a config field, and the bounds left for its Field (a number beside a
    word such as "auto" carries its own bounds)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    if enum_cls is not None:
        ann = Literal[tuple(m.value for m in enum_cls)]
        return (Optional[ann] if optional else ann), bounds
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        words = [a for a in inner if typing.get_origin(a) is Literal]
        if words:
            number = typing.Annotated[inner[0], Field(**bounds)]
            return typing.Union[(number, *words)], {}
        return Optional[_annotation(inner[0], None, {})[0]], bounds
    if origin is tuple:
        return list[args[0]], bounds
    if hint is dict or origin is dict:
        return dict[str, Any], bounds
    return hint, bounds


def _title(path: str) -> str:
    return "".join(p.capitalize() for p in path.replace("_", ".").split(".")) + "Params"


def _model_for(cls, path: str, defaults: dict[str, Any]) -> type[BaseModel]:
    """A pydantic model mirroring dataclass `cls`: same names, types and defaults (the resolved
    run defaults), with descriptions and bounds from DOCS."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        p = f"{path}.{f.name}"
        doc, bounds = DOCS.get(p, (None, {}))
        sub = _SUBCONFIGS.get((cls.__name__, f.name))
        if sub is not None:
            model = _model_for(sub, p, defaults[f.name])
            fields[f.name] = (model, Field(default_factory=model, description=doc))
        elif f.name == "rewards":
            fields[f.name] = (list[RewardParams], Field(default=defaults[f.name], description=doc,
                                                        validate_default=True))
        else:
            ann, bounds = _annotation(hints[f.name], getattr(cls, "_enums", {}).get(f.name), bounds)
            fields[f.name] = (ann, Field(default=defaults[f.name], description=doc, **bounds))
    return create_model(_title(path), __config__=ConfigDict(extra="forbid"), **fields)


class StorageParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    root: str = Field(_DEFAULTS["storage"]["root"], description=DOCS["storage.root"][0], min_length=1)


_LORA = LoraConfig()


class LoraParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: int = Field(_LORA.rank, description=DOCS["model.lora.rank"][0], **DOCS["model.lora.rank"][1])
    alpha: float = Field(_LORA.alpha, description=DOCS["model.lora.alpha"][0], **DOCS["model.lora.alpha"][1])
    target_modules: str = Field(_LORA.target_modules, description=DOCS["model.lora.target_modules"][0],
                                **DOCS["model.lora.target_modules"][1])
    dropout: float = Field(_LORA.dropout, description=DOCS["model.lora.dropout"][0], **DOCS["model.lora.dropout"][1])


class ModelParams(BaseModel):
    # Other keys override the preset's fields (Hugging Face names: hidden_size, dtype, ...).
    model_config = ConfigDict(extra="allow")
    path: Optional[str] = Field(None, description=DOCS["model.path"][0])
    revision: Optional[str] = Field(None, description=DOCS["model.revision"][0])
    preset: Literal[tuple(PRESETS)] = Field(_DEFAULTS["model"]["preset"], description=DOCS["model.preset"][0])
    seed: int = Field(_DEFAULTS["model"]["seed"], description=DOCS["model.seed"][0], ge=0)
    tokenizer: Optional[str] = Field(None, description=DOCS["model.tokenizer"][0])
    lora: Optional[LoraParams] = Field(None, description=DOCS["model.lora"][0])


DataParams = _model_for(DataConfig, "data", _DEFAULTS["data"])
TrainParams = _model_for(TrainConfig, "train", _DEFAULTS["train"])
EvalParams = _model_for(EvalConfig, "eval", _DEFAULTS["eval"])
PipelineParams = _model_for(PipelineConfig, "pipeline", _DEFAULTS["pipeline"])


class RunParams(BaseModel):
    """A GRPO run: where it lives, the model, the data, the rewards, training, evaluation and how
    the stages run. Every field has the embedded default (the tiny preset on the synthetic task)."""

    model_config = ConfigDict(extra="forbid")
    run_name: Optional[str] = Field(None, description=DOCS["run_name"][0])
    storage: StorageParams = Field(default_factory=StorageParams)
    model: ModelParams = Field(default_factory=ModelParams)
    data: DataParams = Field(default_factory=DataParams)
    rewards: list[RewardParams] = Field(default=_DEFAULTS["rewards"], description=DOCS["rewards"][0], min_length=1,
                                        validate_default=True)
    train: TrainParams = Field(default_factory=TrainParams)
    eval: EvalParams = Field(default_factory=EvalParams)
    pipeline: PipelineParams = Field(default_factory=PipelineParams)

    def to_config(self) -> RunConfig:
        # Only the fields that were given: RunConfig applies the defaults that depend on them
        # (evaluation with the user's rewards, no preset or synthetic task with a checkpoint or
        # dataset). A form that sends every field is a complete config and is read as one.
        return RunConfig.from_dict(self.model_dump(exclude_unset=True))
