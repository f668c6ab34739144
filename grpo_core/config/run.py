"""The pipeline's run config: one section per concern, read from YAML with `--set` overrides.

    run_name: null            # null: "{preset}-{hash}" so a changed config never reuses a run
    storage: {root: runs}     # a folder, gs://bucket/prefix or memory://...
    model: {preset: tiny, seed: 0, tokenizer: char, ...ModelConfig overrides}
    data: DataConfig          # grpo_core.data.prepare
    rewards: [{function: char_match, weight: 1.0}, ...]
    train: TrainConfig        # grpo_core.config.train
    eval: EvalConfig
    pipeline: PipelineConfig  # stages: epochs, retries, time limits

Stages key their outputs by hashes of only the sections that matter to them: the prepared data
by `data` and the tokenizer, checkpoints by everything that changes training (model, data,
rewards, train), evaluation by `eval` and the data. Storage, run name and pipeline settings
change no result, so retrying with more retries or a longer time limit resumes the same run.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import pathlib
import posixpath
from typing import Any, ClassVar

import yaml

from grpo_core.config import recipes
from grpo_core.config.data import DataConfig, data_hash
from grpo_core.config.fields import (
    Section,
    Trust,
    apply_overrides,
    check,
    config_hash,
    field,
    placeholders,
    section,
)
from grpo_core.config.launch import LauncherConfig
from grpo_core.config.model import (
    PATH_OVERRIDES,
    DType,
    ModelConfig,
    ModelSection,
    ReferencePolicy,
    model_config_from_hf,
)
from grpo_core.config.presets import get_preset
from grpo_core.config.target import Target
from grpo_core.config.train import ISCorrection, RolloutLayout, TrainConfig
from grpo_core.errors import ConfigError

DEFAULT_STORAGE_ROOT = "runs"  # relative to the folder the flow runs in
DEFAULT: dict[str, Any] = {
    "run_name": None,
    "storage": {"root": DEFAULT_STORAGE_ROOT},
    "model": {"preset": "tiny", "seed": 0, "tokenizer": "char"},
    "data": {
        "source": "synthetic",
        "synthetic": {"alphabet": "abcde", "min_len": 3, "max_len": 3, "seed": 0},
        "max_prompt_tokens": 16,
        "eval_rows": 128,
    },
    # char_match is optimised; exact_match (weight 0) is reported as a training metric.
    "rewards": [{"function": "char_match", "weight": 1.0}, {"function": "exact_match", "weight": 0.0}],
    # The recipe that solves the task (greedy accuracy 1.0 on 3 seeds by step 450 here, where the
    # plain one stalled at 0.54 with its entropy collapsed): DAPO's dynamic sampling and
    # clip-higher, and an entropy bonus.
    "train": {
        "num_steps": 600,
        "seed": 0,
        "grpo": {
            "num_generations": 8,
            "prompts_per_step": 16,
            "loss_aggregation": "token_mean",
            "dynamic_sampling": True,
            "epsilon_high": 0.28,
            "entropy_coef": 0.03,
        },
        "sampling": {"max_new_tokens": 6, "temperature": 1.0},
        "optimizer": {"learning_rate": 5e-4, "warmup_steps": 5, "max_grad_norm": 1.0},
    },
    "eval": {
        "rewards": [{"function": "exact_match"}, {"function": "char_match"}],
        "accuracy_reward": "exact_match",
        "num_samples": 4,
    },
    "pipeline": {"epochs": 4, "checkpoint_every": 50},
}


# `grpo demo --task NAME`: the embedded default (reverse a word), or the synthetic tool task whose
# answer only a tool can tell (train.agent with the built-in codebook environment): the model
# learns to call it (`#` in the plain format) and to answer with what it returned. Greedy
# held-out accuracy 0.00 -> 1.00 in 600 steps, about 2.5 minutes on 2 CPU cores
# (docs/agents.md). Each is a config over DEFAULT, as a --config file would be.
DEMO_TASKS: dict[str, dict[str, Any]] = {
    "reverse": {},
    "tools": {
        "data": {"synthetic": {"task": "codebook", "alphabet": "abcde", "min_len": 3, "max_len": 3, "seed": 0}},
        # char_match on the final answer teaches copying the code; tool_called (a small weight)
        # rewards a call that returned, which the model must find first; exact_match is reported
        "rewards": [
            {"function": "char_match", "weight": 1.0},
            {"function": "tool_called", "weight": 0.2},
            {"function": "exact_match", "weight": 0.0},
        ],
        "eval": {
            "rewards": [{"function": "exact_match"}, {"function": "char_match"}, {"function": "tool_called"}],
            "accuracy_reward": "exact_match",
        },
        "train": {
            "sampling": {"max_new_tokens": 4},  # a call (`#`) or an answer (three digits and the end)
            "agent": {"environment": "codebook", "max_turns": 2, "max_tokens": 16},
        },
    },
}


# Experiment trackers pipeline.report_to names (grpo_core.store.tracking sends to them).
TRACKERS = ("tensorboard", "wandb", "mlflow")


def parse_report_to(value: Any) -> tuple[str, ...]:
    """TRL's forms: a list, one name, "all" or "none"."""
    if value in (None, "none", ""):
        return ()
    names = TRACKERS if value == "all" else (value,) if isinstance(value, str) else tuple(value)
    return tuple(dict.fromkeys(names))


# The fields of the run config that are not in a section.
RUN_DOCS = {
    "run_name": "Folder of this run under storage.root. Empty: named by the preset and the config hash, so the same "
    "config resumes its own run. A template like nightly-{date} ({date}, {time}, {datetime}) is filled in once per "
    "flow run from its scheduled time (UTC), so a retry of that flow run resumes the same folder",
    "storage.root": "Where runs live: a local folder, gs://bucket/prefix or memory://...",
    "rewards": "Built-in rewards (char_match, exact_match, math_answer, think_format, integer_answer), file.py:fn, "
    "module:fn or a reward model {model: ID_OR_FOLDER}, each weighted (0: reported only)",
}


# A reward spec whose file part ends so names a callable pickled by value (grpo_core.rewards.by_value)
PICKLED = ".pkl"
# A reward model's defaults: texts per call (verl's micro-batch) and tokens per text (TRL's RewardConfig.max_length)
MODEL_BATCH_SIZE = 8
MODEL_MAX_LENGTH = 1024

# What the fields outside the sections name, for the trust policy (grpo_core.rewards.trust); the
# sections' fields say it in their declarations.
RUN_TRUST = {"run_name": Trust.SAFE, "storage.root": Trust.WRITES}


@section(path="rewards[]")
class RewardSpec(Section):
    """A reward: a function (a built-in name, see grpo_core.rewards.registry.builtin_rewards, or
    `file.py:fn` / `module:fn`) or a model (a Hugging Face sequence classifier with one label, as
    TRL's reward_funcs takes a model id: grpo_core.rewards.reward_model), and its weight in the
    total (0: reported, not optimised)."""

    function: str | None = field(
        None, doc="built-in name, path/to/file.py:function or module:function", min_length=1, trust=Trust.CODE
    )
    model: str | None = field(
        None,
        doc="A reward model instead of a function: a Hugging Face *ForSequenceClassification with one label "
        "(Qwen2, Qwen3, Llama) as a Hub id, a folder or a gs:// folder; it scores the prompt and completion "
        "through its own tokenizer and chat template, on the run's devices, in the run's dtype",
        min_length=1,
        trust=Trust.READS,
    )
    weight: float = field(1.0, doc="weight in the total reward (0: reported, not optimised)")
    # keyword arguments of the call, e.g. soft_overlong's {max_completion_len: 512, soft_punish_cache: 128}
    params: dict | None = field(
        None, doc="keyword arguments the function is called with (a built-in's settings)", trust=Trust.SAFE
    )
    # a reward model's settings (None: the defaults below; a function takes none of them)
    batch_size: int | None = field(
        None,
        doc=f"With model: texts the reward model scores per call (empty: {MODEL_BATCH_SIZE})",
        ge=1,
        api_max=1024,
    )
    max_length: int | None = field(
        None,
        doc=f"With model: the most tokens of a text it scores (empty: {MODEL_MAX_LENGTH}); a longer text loses its "
        "first tokens (the end, the completion, is what it scores)",
        ge=8,
        api_max=131072,
    )
    clip: tuple[float, ...] | None = field(
        None,
        doc="With model: [low, high] its scores are clipped to (OpenRLHF's reward_clip_range); empty: none",
        trust=Trust.SAFE,
    )

    MODEL_ONLY: ClassVar[tuple[str, ...]] = ("batch_size", "max_length", "clip")

    def validate(self) -> None:
        check(
            (self.function is None) != (self.model is None),
            "rewards[] must name a function or a model (one of them), got "
            + (f"both {self.function!r} and {self.model!r}" if self.function else "neither"),
        )
        if self.function is not None:
            check(
                isinstance(self.function, str) and bool(self.function),
                f"rewards[].function must be a name or 'file.py:function', got {self.function!r}",
            )
            for name in self.MODEL_ONLY:
                check(
                    getattr(self, name) is None,
                    f"rewards[].{name} applies to a reward model (rewards[].model), not to the function "
                    f"{self.function!r}",
                )
        else:
            check(
                isinstance(self.model, str) and bool(self.model.strip("/ ")),
                f"rewards[].model must be a Hugging Face id, folder or URL, got {self.model!r}",
            )
            check(
                not self.params,
                f"rewards[].params are a function's keywords; the reward model {self.model!r} takes none",
            )
        check(
            self.params is None or (isinstance(self.params, dict) and all(isinstance(k, str) for k in self.params)),
            f"rewards[].params must map keyword names to values, got {self.params!r}",
        )
        if self.clip is not None:
            check(
                len(self.clip) == 2 and self.clip[0] < self.clip[1],
                f"rewards[].clip must be [low, high] with low < high, got {list(self.clip)!r}",
            )

    @property
    def name(self) -> str:
        """What it is reported as (rewards/<name>/mean): the function's name, or as TRL names a reward
        model, the last part of its id or folder."""
        if self.function is not None:
            return self.function.rsplit(":", 1)[-1]
        return self.model.rstrip("/").rsplit("/", 1)[-1]

    @property
    def model_batch_size(self) -> int:
        return self.batch_size or MODEL_BATCH_SIZE

    @property
    def model_max_length(self) -> int:
        return self.max_length or MODEL_MAX_LENGTH

    def to_dict(self) -> dict[str, Any]:
        """The fields given: a function's spec as before reward models (function, weight, params)."""
        d = super().to_dict()
        return {k: v for k, v in d.items() if not (v is None and k in ("function", "model", *self.MODEL_ONLY))}

    def hash_dict(self) -> dict[str, Any]:
        """to_dict() without params when there are none: rewards written before it keep their hashes."""
        d = self.to_dict()
        if not d.get("params"):
            d.pop("params", None)
        return d


def _reward_specs(value: Any, field: str) -> tuple[RewardSpec, ...]:
    check(
        isinstance(value, (list, tuple)) and len(value) > 0,
        f"{field} must be a non-empty list of {{function, weight}}, got {value!r}",
    )
    out = []
    for i, item in enumerate(value):
        if isinstance(item, RewardSpec):
            out.append(item)
            continue
        if isinstance(item, str):
            item = {"function": item}
        check(isinstance(item, dict), f"{field}[{i}] must be a mapping like {{function: exact_match}}, got {item!r}")
        out.append(RewardSpec.from_dict(item, f"{field}[{i}]"))
    return tuple(out)


@section(path="eval")
class EvalConfig(Section):
    """Evaluation of the starting policy and of each epoch's checkpoint on the eval split."""

    # RewardSpecs; empty: the training rewards (the default when the config sets rewards)
    rewards: tuple = field((), doc="Rewards evaluation reports; empty: the training rewards", trust=Trust.CODE)
    # The eval reward whose greedy mean is "accuracy"; unset with your own rewards: the first
    # with a weight above 0.
    accuracy_reward: str = field(
        "exact_match", doc="The eval reward whose greedy mean is 'accuracy' and which decides pass@k", trust=Trust.SAFE
    )
    # sampled completions per prompt for pass@k (1: greedy only)
    num_samples: int = field(4, doc="Samples per prompt for pass@k (1: greedy only)", ge=1, api_max=64)
    # for the pass@k samples
    temperature: float = field(1.0, doc="Temperature of the pass@k samples", gt=0)
    batch_size: int = field(64, doc="Prompts per evaluation batch", ge=1, api_max=4096)

    def validate(self) -> None:
        object.__setattr__(self, "rewards", _reward_specs(self.rewards, "eval.rewards") if self.rewards else ())


@section(path="pipeline.readiness")
class ReadinessConfig(Section):
    """The `pipeline.readiness` section: the TPU slice the readiness stage compiles the run's
    programs for (grpo_core.stages.aot), from whatever host it runs on. In no stage hash."""

    target: str | None = field(
        None,
        doc="TPU topology to AOT-compile every program of the run for and check against its HBM with XLA's "
        "own figures, e.g. v5e:2x2, v5e:2x4, v4:2x2x1, v6e:4x4 (needs libtpu: pip install '.[tpu-aot]'); "
        "empty: none",
        trust=Trust.SAFE,
    )
    num_slices: int = field(1, doc="Slices of the target (multislice, over the data-center network)", ge=1, api_max=64)

    def validate(self) -> None:
        if self.target is not None:
            Target.parse(self.target, self.num_slices)  # ConfigError naming pipeline.readiness.target


@section(path="pipeline")
class PipelineConfig(Section):
    """How the stages run. Nothing here changes a result, so none of it is in a stage hash."""

    # training stages; train.num_steps is split evenly across them
    epochs: int = field(4, doc="Training stages; train.num_steps is split evenly across them", ge=1, api_max=1000)
    # steps between checkpoints (and metric shards)
    checkpoint_every: int = field(50, doc="Steps between checkpoints", ge=1)
    # the 3 newest checkpoints are kept; with this, each epoch's last one too
    keep_epoch_checkpoints: bool = field(
        True, doc="Keep each epoch's last checkpoint (to evaluate or export later) besides the 3 newest"
    )
    # readiness fails unless the worker sees a TPU
    require_tpu: bool = field(False, doc="Fail readiness unless the worker sees a TPU")
    # a TPU topology the run's programs are compiled for before it starts
    readiness: ReadinessConfig = field(
        factory=ReadinessConfig,
        doc="The TPU topology (e.g. v5e:2x2) readiness compiles every program for, from any host",
    )
    # task retries of crashes, preemption and storage errors
    retries: int = field(2, doc="Task retries of crashes, preemption and storage errors", ge=0, api_max=10)
    retry_delay_s: float = field(2.0, doc="Seconds between task retries", ge=0)
    flow_retries: int = field(1, doc="Retries of the whole flow run", ge=0, api_max=10)
    lease_ttl_s: float = field(120.0, doc="Seconds a run root's lease outlives its holder's last heartbeat", gt=0)
    # hard limit per training-epoch attempt: the worker is killed
    train_timeout_s: float = field(3600.0, doc="Hard limit per training-epoch attempt, seconds", gt=0)
    eval_timeout_s: float = field(1800.0, doc="Hard limit per evaluation attempt, seconds", gt=0)
    check_timeout_s: float = field(600.0, doc="Hard limit for the device checks, seconds", gt=0)
    # write the final policy as a Hugging Face folder, export/{step}/
    export: bool = field(
        True,
        doc="Write the final policy as a Hugging Face folder (safetensors, config, tokenizer) under export/{step}/",
    )
    export_timeout_s: float = field(1800.0, doc="Hard limit for the export, seconds", gt=0)
    # steps in a row on which every group's completions got the same reward: no advantage, no signal
    zero_signal_steps: int = field(
        20,
        doc="Warn after this many steps in a row on which every group's rewards were all equal (nothing to learn)",
        ge=1,
    )
    zero_signal_fail_steps: int = field(
        0,
        doc="Fail the run (a reward error) after this many such steps in a row; 0: warn only (a converged "
        "policy scores every completion alike too)",
        ge=0,
    )
    # as TRL's report_to: the metrics also go to these trackers (grpo_core.store.tracking)
    report_to: tuple[str, ...] = field(
        (),
        doc="Experiment trackers the metrics also go to: tensorboard (event files in {run}/tensorboard/), "
        "wandb (WANDB_BASE_URL, else api.wandb.ai; files in {run}/wandb/), mlflow (MLFLOW_TRACKING_URI, else "
        "{run}/mlflow.db); 'all' or 'none' as in TRL. From a deployment run a tracker that sends is an address",
        trust=Trust.ADDRESS,
    )
    tracking_project: str = field(
        "grpo", doc="The W&B project and MLflow experiment of the run", min_length=1, trust=Trust.SAFE
    )

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str | None = None):
        data = dict(data)
        if isinstance(data.get("report_to"), str):  # TRL's forms: one name, "all", "none"
            data["report_to"] = parse_report_to(data["report_to"])
        return super().from_dict(data, path)

    def validate(self) -> None:
        unknown = [n for n in self.report_to if n not in TRACKERS]
        check(not unknown, f"pipeline.report_to: unknown tracker(s) {unknown}; known: {list(TRACKERS)}, all, none")

    # The interpreter of training workers; null: this one, or the sglang-jax environment
    # (GRPO_SGLANG_PYTHON, else .venv-sglang/bin/python) when train.rollout.engine is sglang.
    worker_python: str | None = field(
        None,
        doc="Interpreter of the training workers; empty: this one, or .venv-sglang's with train.rollout.engine=sglang",
        trust=Trust.PROGRAM,
    )
    # How workers start: here (local), as N processes on this machine (multiprocess), on every
    # host of a Ray cluster (ray) or of a TPU VM slice (tpu-vm); see grpo_core.launch.launchers.
    launcher: LauncherConfig = field(
        factory=LauncherConfig,
        doc="How workers start: one process here, N processes on this machine, a Ray cluster or a TPU VM slice",
    )


# model.init_from resolved (grpo_core.store.startpoint): the kinds of policy a run holds, and the
# version recorded where a pattern matched no finished run yet.
KINDS = ("checkpoint", "export")
NO_MATCH = "base:no finished run matched"


@dataclasses.dataclass(frozen=True)
class StartPoint:
    """The policy of another run a continual run starts from (model.init_from, as resolved)."""

    run_url: str
    step: int
    kind: str  # "checkpoint" or "export"
    train_hash: str  # the source run's, as its config.json records it

    @property
    def version(self) -> str:
        return f"{self.run_url}@{self.step}:{self.kind}:{self.train_hash}"

    @classmethod
    def parse(cls, version: str) -> "StartPoint | None":
        """From a recorded version; None where a pattern matched no finished run (NO_MATCH)."""
        if version.startswith(NO_MATCH):
            return None
        where, kind, train_hash = version.rsplit(":", 2)
        run_url, step = where.rsplit("@", 1)
        if kind not in KINDS or not step.isdigit():
            raise ConfigError(f"versions['model.init_from'] {version!r} is not '<run>@<step>:<kind>:<hash>'")
        return cls(run_url, int(step), kind, train_hash)

    @property
    def uri(self) -> str:
        """The folder of the policy: checkpoints/{step} or export/{step} of the run."""
        folder = "checkpoints" if self.kind == "checkpoint" else "export"
        return posixpath.join(self.run_url.rstrip("/"), folder, str(self.step))  # as RunRoot.uri joins

    def describe(self) -> dict[str, Any]:
        return {"run": self.run_url, "step": self.step, "kind": self.kind, "uri": self.uri}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    run_name: str | None
    storage_root: str
    model: ModelSection
    data: DataConfig
    rewards: tuple[RewardSpec, ...]
    train: TrainConfig
    eval: EvalConfig
    pipeline: PipelineConfig
    # The versions of the sources the config names, by field (grpo_core.store.versions): part of
    # the data and training hashes, so new content is a new run. Set by grpo_core.resolve.resolve_run.
    versions: tuple[tuple[str, str], ...] = ()
    # Set where `rewards` is a default chosen for the user's data (recipes.RewardChoice: why, and
    # whether the data's first row still decides: grpo_core.resolve). Not in
    # to_dict: config.json and the flow's parameters hold the rewards themselves.
    rewards_default: recipes.RewardChoice | None = dataclasses.field(default=None, compare=False)

    SECTIONS = ("run_name", "storage", "model", "data", "rewards", "train", "eval", "pipeline")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        check(isinstance(data, dict), f"the config must be a mapping, got {type(data).__name__}")
        data = {k: v for k, v in data.items() if k != "hashes"}  # derived; config.json records them
        versions = data.pop("versions", None) or {}  # recorded in config.json by resolve_run
        check(
            isinstance(versions, dict) and all(isinstance(v, str) for v in versions.values()),
            f"versions must map fields to versions, got {versions!r}",
        )
        unknown = sorted(set(data) - set(cls.SECTIONS))
        check(not unknown, f"unknown config section(s) {unknown}; known: {list(cls.SECTIONS)}")
        base = copy.deepcopy(DEFAULT)
        if isinstance(data.get("data"), dict) and data["data"].get("source", "synthetic") != "synthetic":
            base["data"] = {}  # the synthetic defaults (prompt length, task) do not apply to a user's data
        if isinstance(data.get("model"), dict) and data["model"].get("path"):
            base["model"] = {"seed": 0}  # a checkpoint brings its own architecture and tokenizer
        # the synthetic task's tuned recipe, or on the user's data or a real model the defaults of
        # TRL and verl (grpo_core.config.recipes; `grpo check` says which filled what)
        base = recipes.apply(base, data)
        # no rewards on the user's data: ones that fit it, not the synthetic task's (math_answer
        # where the rows carry a reference answer; recipes.default_rewards), else refused
        chosen = recipes.default_rewards(data)
        if chosen is not None:
            base["rewards"] = [dict(s) for s in chosen.specs]
        if data.get("rewards") or chosen is not None:  # evaluate with them unless eval.rewards says otherwise
            base["eval"] = {k: v for k, v in base["eval"].items() if k not in ("rewards", "accuracy_reward")}
        d = _merge(base, data)
        storage = d["storage"]
        check(
            isinstance(storage, dict) and set(storage) <= {"root"},
            f"storage must be a mapping with 'root', got {storage!r}",
        )
        root = storage.get("root")
        check(isinstance(root, str) and bool(root), f"storage.root must be a folder or URL, got {root!r}")
        name = d["run_name"]
        check(name is None or isinstance(name, str), f"run_name must be a single folder name, got {name!r}")
        if name is not None:
            check_run_name(name)
        if name is not None and is_template(name):
            format_run_name(
                name, datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc)
            )  # names a bad placeholder now
        cfg = cls(
            run_name=name,
            storage_root=root,
            model=_model_section(d["model"]),
            data=_section(DataConfig, d["data"], "data"),
            rewards=_reward_specs(d["rewards"], "rewards"),
            train=_section(TrainConfig, d["train"], "train"),
            eval=_section(EvalConfig, d["eval"], "eval"),
            pipeline=_section(PipelineConfig, d["pipeline"], "pipeline"),
            versions=tuple(sorted(versions.items())),
            rewards_default=chosen,
        )
        if "accuracy_reward" not in (d["eval"] if isinstance(d["eval"], dict) else {}):
            specs = cfg.eval_rewards
            first = next((r for r in specs if r.weight > 0), specs[0])
            cfg = dataclasses.replace(cfg, eval=cfg.eval.replace(accuracy_reward=first.name))
        names = [r.name for r in cfg.eval_rewards]
        check(
            cfg.eval.accuracy_reward in names,
            f"eval.accuracy_reward {cfg.eval.accuracy_reward!r} is not one of the eval rewards {names}",
        )
        check(
            cfg.train.rollout.layout is not RolloutLayout.SPLIT or not any(r.model for r in cfg.rewards),
            "rewards[].model is scored on the learner's devices, which train.rollout.layout=split's rollout process "
            "does not hold: use layout: colocated (train.max_staleness still overlaps the rollout with the update) "
            "or a reward function",
        )
        compute = cfg.compute_dtype  # validates the model section now, not in a worker
        ro = cfg.train.rollout
        check(
            ro.is_correction in (ISCorrection.AUTO, ISCorrection.OFF) or ro.learner_logprobs(compute),
            f"train.rollout.is_correction={ro.is_correction.value} weighs the rollout engine's log-probs against the "
            "learner's rescoring of the same tokens, which this config does not do (the built-in float32 sampler's "
            "own log-probs are the learner's): set train.rollout.recompute_logprobs: true, or is_correction: off",
        )
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_name": self.run_name,
            "storage": {"root": self.storage_root},
            "model": self.model.to_dict(),
            "data": self.data.to_dict(),
            "rewards": [r.to_dict() for r in self.rewards],
            "train": self.train.to_dict(),
            "eval": self.eval.to_dict(),
            "pipeline": self.pipeline.to_dict(),
            **({"versions": dict(self.versions)} if self.versions else {}),
        }

    def with_run_name(self, when: datetime.datetime) -> "RunConfig":
        """This config with a run_name template ({date}, {time}, {datetime}) filled in for `when`."""
        if not self.run_name or not is_template(self.run_name):
            return self
        return dataclasses.replace(self, run_name=format_run_name(self.run_name, when))

    @property
    def separate_reference(self) -> bool:
        """Whether the KL reference is weights of its own: a continual run's base (model.reference: base)."""
        return self.model.init_from is not None and self.model.reference is ReferencePolicy.BASE

    @property
    def start_point(self):
        """Where training starts with model.init_from (grpo_core.store.startpoint.StartPoint), as
        resolve_run resolved it; None without init_from."""
        if self.model.init_from is None:
            return None
        version = dict(self.versions).get("model.init_from")
        if version is None:
            raise ConfigError(
                f"model.init_from {self.model.init_from!r} is not resolved to a run and step (resolve_run does that)"
            )
        return StartPoint.parse(version)

    # -- derived ---------------------------------------------------------------------------

    @property
    def model_path(self) -> str | None:
        """A Hugging Face id, folder or gs:// folder to start from (grpo_core.store.sources); None: a preset."""
        return self.model.path

    @property
    def tokenizer_id(self) -> str:
        """'char', or where an HF tokenizer comes from ('hf:' + its path[@revision]): part of the data hash."""
        tok = self.model.tokenizer
        if tok == "char":
            return tok
        where = self.model_path if tok == "auto" else tok
        rev = self.model.revision
        return f"hf:{where}" + (f"@{rev}" if rev else "")

    @property
    def tokenizer_source(self) -> str | None:
        """Where AutoTokenizer loads from: the model's own folder ('auto') or another id/folder."""
        tok = self.model.tokenizer
        return None if tok == "char" else (self.model_path if tok == "auto" else tok)

    def model_config(self, vocab_size: int | None = None, checkpoint: dict[str, Any] | None = None) -> ModelConfig:
        """The architecture: the preset's (its vocab_size the tokenizer's unless set), or with
        model.path the `checkpoint`'s config.json, which grpo_core.store.sources.model_config reads."""
        fields = dict(self.model.overrides)
        if self.model_path:
            self._check_path_overrides()
            if checkpoint is None:
                raise ValueError(
                    f"model.path {self.model_path!r}: the architecture is in its config.json "
                    "(grpo_core.store.sources.model_config reads it)"
                )
            return model_config_from_hf(checkpoint, f"{self.model_path}/config.json", **fields)
        if vocab_size is not None:
            fields.setdefault("vocab_size", vocab_size)
        try:
            return get_preset(self.model.preset or "tiny", **fields)
        except TypeError as exc:  # dataclasses.replace on an unknown field
            known = sorted(f.name for f in dataclasses.fields(ModelConfig))
            raise ConfigError(f"model: {exc}; ModelConfig fields are {known}") from None

    def _check_path_overrides(self) -> None:
        fixed = sorted(set(self.model.overrides) - set(PATH_OVERRIDES))
        check(
            not fixed,
            f"model.{', model.'.join(fixed)}: set by the checkpoint at model.path "
            f"{self.model_path!r}; only {', '.join(PATH_OVERRIDES)} may be overridden",
        )

    @property
    def compute_dtype(self) -> DType:
        """The model's compute dtype, known without reading a checkpoint (model.path leaves dtype open)."""
        if not self.model_path:
            return self.model_config().dtype
        self._check_path_overrides()
        return get_preset("tiny", **{k: v for k, v in self.model.overrides.items() if k in PATH_OVERRIDES}).dtype

    @property
    def data_hash(self) -> str:
        return data_hash(self.data, self.tokenizer_id, self.data_versions)

    @property
    def data_versions(self) -> dict[str, str]:
        """The versions the prepared data depends on: its sources and the tokenizer's (the model
        folder's when the tokenizer is the model's own)."""
        keep = {"data.source", "data.eval_source", "model.tokenizer"}
        if self.model.tokenizer == "auto":
            keep.add("model.path")
        # a chat template renders the tools' schemas (their docstrings and hints) into the prompts
        return {k: v for k, v in self.versions if k in keep or k.startswith("train.agent.")}

    @property
    def train_hash(self) -> str:
        versions = dict(self.versions)
        return config_hash(
            {
                "model": self.model.to_dict(),
                "data": self.data_hash,
                "rewards": [r.hash_dict() for r in self.rewards],
                "train": self.train.hash_fields(),
                # the starting weights' version (absent where none is known: older hashes hold)
                **({"model_version": versions["model.path"]} if "model.path" in versions else {}),
                # the run and step a continual run starts from (model.init_from)
                **({"init": versions["model.init_from"]} if "model.init_from" in versions else {}),
                # what the reward files and reward models say, not only where they are (versions of
                # rewards[i].function and rewards[i].model; absent for built-ins: older hashes hold)
                **({"code": code} if (code := self.code_versions("rewards[", "train.agent.")) else {}),
            }
        )

    @property
    def eval_hash(self) -> str:
        # the evaluation rewards' code versions (the training rewards' where eval.rewards is empty)
        code = self.code_versions("eval.rewards[" if self.eval.rewards else "rewards[", "train.agent.")
        return config_hash(
            {
                "eval": dict(self.eval.to_dict(), rewards=[r.hash_dict() for r in self.eval.rewards]),
                "data": self.data_hash,
                "model": self.model.to_dict(),
                "max_new_tokens": self.train.sampling.max_new_tokens,
                **({"code": code} if code else {}),
                # evaluation runs the same episodes (absent for single-turn runs: older hashes hold)
                **({"agent": agent} if (agent := self.train.agent.hash_fields()) is not None else {}),
            }
        )

    @property
    def eval_rewards(self) -> tuple[RewardSpec, ...]:
        return self.eval.rewards or self.rewards

    @property
    def code(self) -> tuple[tuple[str, str], ...]:
        """(field, spec) of each piece of code the config names (`file.py:fn`, `module:fn`, a
        built-in's name): what the trust policy checks and whose files' content versions a run."""
        agent = self.train.agent
        return (
            *(
                (f"{where}[{i}].function", spec.function)
                for where, specs in (("rewards", self.rewards), ("eval.rewards", self.eval.rewards))
                for i, spec in enumerate(specs)
                if spec.function is not None
            ),
            *((f"train.agent.tools[{i}]", spec) for i, spec in enumerate(agent.tools)),
            *((("train.agent.environment", agent.environment),) if agent.environment else ()),
        )

    @property
    def reward_models(self) -> tuple[tuple[str, RewardSpec], ...]:
        """(field, spec) of each reward model the config names (rewards[i].model, eval.rewards[i].model):
        places it reads (the trust policy), sources with a version (the run's identity)."""
        return tuple(
            (f"{where}[{i}].model", spec)
            for where, specs in (("rewards", self.rewards), ("eval.rewards", self.eval.rewards))
            for i, spec in enumerate(specs)
            if spec.model is not None
        )

    def code_versions(self, *prefixes: str) -> dict[str, str]:
        """The recorded content versions of the code under fields starting with `prefixes`."""
        return {k: v for k, v in self.versions if k.startswith(prefixes)}

    @property
    def name(self) -> str:
        """The run's folder: run_name, or the preset and the training hash."""
        if self.run_name:
            if is_template(self.run_name):
                raise ConfigError(
                    f"run_name {self.run_name!r} is a template: it names a folder once filled in for a time "
                    "(the flow does that once per flow run)"
                )
            return self.run_name.strip("/")
        base = self.model_path.rstrip("/").rsplit("/", 1)[-1] if self.model_path else (self.model.preset or "tiny")
        return f"{''.join(c if c.isalnum() or c in '.-_' else '-' for c in base)}-{self.train_hash[:8]}"

    @property
    def storage_url(self) -> str:
        """storage.root; a local folder made absolute, so worker processes agree on it."""
        root = self.storage_root
        return root.rstrip("/") if "://" in root else os.path.abspath(os.path.expanduser(root))

    @property
    def run_url(self) -> str:
        return f"{self.storage_url}/{self.name}"

    def epoch_end(self, epoch: int) -> int:
        """The step count at the end of epoch `epoch` (0-based): num_steps split evenly."""
        e = self.pipeline.epochs
        check(
            self.train.num_steps != "auto",
            "train.num_steps is auto, which the data's row count makes a number before a run starts "
            "(grpo_core.resolve.resolve_run): the data could not be prepared",
        )
        return (self.train.num_steps * (epoch + 1)) // e


# run_name templates: filled in from the flow run's scheduled time (UTC), once per flow run.
RUN_NAME_FIELDS = {
    "date": "%Y-%m-%d",
    "time": "%H%M%S",
    "datetime": "%Y-%m-%d-%H%M%S",
}


def is_template(name: str) -> bool:
    return "{" in name or "}" in name


def format_run_name(template: str, when: datetime.datetime) -> str:
    """`template` with {date}, {time} and {datetime} of `when` (in UTC), or ConfigError naming run_name."""
    placeholders(  # before anything is formatted
        template,
        "run_name",
        tuple(RUN_NAME_FIELDS),
        f"{', '.join('{' + k + '}' for k in RUN_NAME_FIELDS)} (the flow run's scheduled time, UTC)",
    )
    when = when.astimezone(datetime.timezone.utc) if when.tzinfo else when
    values = {k: when.strftime(f) for k, f in RUN_NAME_FIELDS.items()}
    name = template.format(**values)
    check(not is_template(name), f"run_name {template!r} does not name a single folder: {name!r}")
    check_run_name(name, f"run_name {template!r} filled in")
    return name.strip("/")


def check_run_name(name: str, what: str = "run_name") -> None:
    """ConfigError unless `name` is one folder under storage.root (a trailing / is allowed): not
    empty, `.` or `..`, no absolute path, no separator (/ or \\), no control character."""
    bare = name.rstrip("/")
    problems = (
        (not bare.strip(), "it is empty"),
        (name.startswith("/"), "it is an absolute path"),
        ("/" in bare or "\\" in bare, "it holds a path separator"),
        (bare in (".", ".."), "it names the storage root or its parent"),
        (any(ord(c) < 32 or ord(c) == 127 for c in name), "it holds a control character"),
    )
    why = next((why for bad, why in problems if bad), None)
    check(why is None, f"{what} must be a single folder name, got {name!r}: {why}")
    check(
        not bare.startswith("_"),
        f"{what} may not start with '_', got {name!r}: names like _flow-runs are the storage root's own records",
    )


def _model_section(value: Any) -> ModelSection:
    try:
        return ModelSection.from_value(value)
    except ConfigError as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith("model") else f"model: {msg}") from None


def _section(cls, value: Any, name: str):
    check(isinstance(value, dict), f"{name} must be a mapping, got {value!r}")
    try:
        return cls.from_dict(value)
    except ConfigError as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith(name) else f"{name}: {msg}") from None
    except TypeError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _merge(base: dict, top: dict) -> dict:
    """`top` over `base`, recursively for mappings; lists and scalars replace."""
    out = copy.deepcopy(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def load_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """DEFAULT, then the YAML file, then `key=value` overrides; validated, or ConfigError."""
    return RunConfig.from_dict(read_config(path, overrides))


def read_config(path: str | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The YAML file with `key=value` overrides applied: what the user gave, before the defaults
    (a deployment's parameters, so a field left out there is the default for the run's config)."""
    data: dict[str, Any] = {}
    if path:
        p = pathlib.Path(path)
        try:
            loaded = yaml.safe_load(p.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        check(
            isinstance(loaded, dict) or loaded is None,
            f"config file {path}: expected a mapping at the top level, got {type(loaded).__name__}",
        )
        data = loaded or {}
    return absolute_paths(apply_overrides(data, overrides or []))


def absolute_paths(data: dict[str, Any]) -> dict[str, Any]:
    """Local files named relative to where the command runs (a data file or folder, a reward
    file) become absolute: workers, deployments and retries may run elsewhere."""
    data = copy.deepcopy(data)
    section = data.get("data")
    if isinstance(section, dict) and isinstance(section.get("source"), str) and os.path.exists(section["source"]):
        section["source"] = os.path.abspath(section["source"])
    model = data.get("model")
    for key in ("path", "tokenizer"):
        if isinstance(model, dict) and isinstance(model.get(key), str) and os.path.isdir(model[key]):
            model[key] = os.path.abspath(model[key])
    for key in ("rewards", "eval"):
        specs = data.get(key, {}).get("rewards") if key == "eval" and isinstance(data.get(key), dict) else data.get(key)
        for spec in specs if isinstance(specs, list) else []:
            function = spec.get("function") if isinstance(spec, dict) else None
            where = function.rsplit(":", 1)[0] if isinstance(function, str) else ""
            if where.endswith(".py") and os.path.exists(where):
                spec["function"] = f"{os.path.abspath(where)}:{function.rsplit(':', 1)[1]}"
            model = spec.get("model") if isinstance(spec, dict) else None
            if isinstance(model, str) and os.path.isdir(os.path.expanduser(model)):  # a folder, as model.path's
                spec["model"] = os.path.abspath(os.path.expanduser(model))
    train = data.get("train")
    agent = train.get("agent") if isinstance(train, dict) else None
    if isinstance(agent, dict):  # tools and the environment: code files as the rewards'
        if isinstance(agent.get("tools"), list):
            agent["tools"] = [_absolute_code(t) for t in agent["tools"]]
        if isinstance(agent.get("environment"), str):
            agent["environment"] = _absolute_code(agent["environment"])
    return data


def _absolute_code(spec: Any) -> Any:
    """`path/file.py:name` with the file made absolute where it exists here; anything else as it is."""
    if not isinstance(spec, str) or ":" not in spec:
        return spec
    where, name = spec.rsplit(":", 1)
    return f"{os.path.abspath(where)}:{name}" if where.endswith(".py") and os.path.exists(where) else spec
