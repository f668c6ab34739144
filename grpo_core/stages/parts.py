"""From a RunConfig to the objects a worker needs: tokenizer, policy, reward functions, and the
prepared prompts read back from the run root. Stage code (training, evaluation) starts here."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from grpo_core.agent.episodes import Turns
from grpo_core.agent.tools import load_toolbox
from grpo_core.config.model import ReferencePolicy
from grpo_core.config.run import RunConfig
from grpo_core.data.prepare import load_prepared
from grpo_core.data.tokenizer import make_tokenizer
from grpo_core.errors import ConfigError
from grpo_core.generate.sampler import stop_ids
from grpo_core.nn import lora
from grpo_core.nn.hf import load_hf_model, save_hf_model
from grpo_core.nn.model import create_model
from grpo_core.rewards.functions import Reward
from grpo_core.rewards.registry import config_rewards
from grpo_core.rl.checkpoint import HOST, Checkpointer
from grpo_core.store.root import RunRoot
from grpo_core.store.sources import model_config, resolve
from grpo_core.store.startpoint import COPY, copy_of, source_gone


@dataclasses.dataclass
class RunParts:
    cfg: RunConfig
    root: RunRoot
    tokenizer: Any
    rewards: list[Reward]
    eval_rewards: list[Reward]
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]

    def model_config(self):
        return model_config(self.cfg, vocab_size=self.tokenizer.vocab_size)

    def turns(self, sampling=None):
        """With train.agent, what an evaluation's episodes need (grpo_core.agent.episodes.Turns) for
        `sampling` (the evaluation's); None for a single-turn run."""
        agent = self.cfg.train.agent
        if not agent.enabled:
            return None
        sampling = sampling or self.cfg.train.sampling
        return Turns.of(
            agent,
            self.tokenizer,
            load_toolbox(agent),
            stop_ids(self.tokenizer),
            self.tokenizer.pad_token_id,
            sampling.prompt_buckets,
            sampling.max_new_tokens,
        )

    def create_policy(self, placement=None):
        """The starting policy: the policy model.init_from resolved to, else the checkpoint at
        model.path or a preset initialised from model.seed; with fresh LoRA adapters when
        model.lora is set; every process builds the same. With a `placement`, Hugging Face
        weights are loaded straight onto its mesh."""
        start = self.cfg.start_point
        model = self._base_policy(placement) if start is None else self._policy_of(start, placement)
        if self.cfg.model.lora is not None:
            lora.apply(model, self.cfg.model.lora, self.cfg.model.seed)
        return model

    def policy_shapes(self):
        """The policy as shapes only (nothing initialised or read), where a checkpoint of this run
        holds every parameter to fill it with: without LoRA (its checkpoints hold the adapters
        alone) and without model.init_from (whose policy's architecture is the other run's); else
        None, and the policy is built (create_policy) for a checkpoint to overwrite."""
        if self.cfg.model.lora is not None or self.cfg.start_point is not None:
            return None
        return self._base_policy(shapes_only=True)

    def reference_policy(self, placement=None):
        """The KL reference when it is not the starting policy: the base model (model.path or the
        preset) of a run started from another run's policy with model.reference: base; else None."""
        if self.cfg.start_point is None or self.cfg.model.reference is ReferencePolicy.START:
            return None
        return self._base_policy(placement)

    def policy_at(self, ckpt, step: int, placement=None, on_host: bool = False):
        """(graphdef, params) of the starting policy (step 0) or of checkpoint `step` of this run.
        Where the checkpoint holds every parameter (no LoRA: with it the checkpoint holds only the
        adapters) the policy is built as shapes only, not initialised or read from model.path
        first and then overwritten (a 0.5B model's weights read twice per evaluated step).
        The parameters lie on this process's first device, or with a `placement` whose rollout
        mesh has several devices, laid out over that mesh, read or loaded straight into their
        shards (a model larger than one chip: the 7B recipe's 30 GB of f32 on 16 GB chips).
        `on_host`: a checkpoint's parameters as numpy arrays in this process's memory (an export
        writes them tensor by tensor; the starting policy is built as without)."""
        mesh = None if placement is None else placement.spread_rollout()
        onto = placement if mesh is not None else None  # Hugging Face weights loaded onto its mesh
        if step == 0 and 0 not in ckpt.all_steps():
            graphdef, params = nnx.split(self.create_policy(onto))
            if mesh is not None:
                return graphdef, placement.put_params(params, mesh)
            # committed to the device a restored checkpoint's arrays are on (Checkpointer.restore):
            # uncommitted, they lowered to other programs, so an evaluation of step 0 and a trained
            # step compiled (and cached) every sampler program twice
            return graphdef, jax.device_put(params, jax.local_devices()[0])
        if step not in ckpt.all_steps():
            raise ConfigError(
                f"no checkpoint for step {step} under {ckpt.directory}; finalised checkpoints: "
                f"{ckpt.all_steps() or 'none'}"
            )
        layout = HOST if on_host else None if mesh is None else lambda tree: placement.param_shardings(tree, mesh)
        # as saved, plain nested dicts; no optimizer moments
        state, meta = ckpt.restore(step, only="params", layout=layout)
        if meta.get("config_hash") != self.cfg.train_hash:
            raise ConfigError(
                f"checkpoint {step} in {ckpt.directory} was trained with another config "
                f"({meta.get('config_hash')!r}, this run is {self.cfg.train_hash!r})"
            )
        shapes = self.policy_shapes()
        graphdef, params = nnx.split(self.create_policy(onto) if shapes is None else shapes)
        nnx.replace_by_pure_dict(params, _unwrap(state["params"]))
        unfilled = [
            jax.tree_util.keystr(p)
            for p, v in jax.tree_util.tree_leaves_with_path(params)
            if not isinstance(v, (jax.Array, np.ndarray))
        ]
        if unfilled:
            raise ConfigError(f"checkpoint {step} in {ckpt.directory} lacks parameters {unfilled[:5]}")
        return graphdef, params

    def _policy_of(self, start, placement=None):
        """The plain model (LoRA merged) of another run's export or checkpoint (model.init_from):
        from the run's own copy (start/) once it holds one."""
        own = copy_of(self.root, start)
        if own is not None:
            return self._load_hf(own, None, placement)
        if source_gone(start):
            raise ConfigError(
                f"model.init_from {self.cfg.model.init_from!r}: the policy this run starts from ({start.uri}) is "
                f"gone, and the run at {self.root.url} holds no copy of it (a run copies it at its first training "
                "step): restore that run, or start from another"
            )
        if start.kind == "export":
            return self._load_hf(start.uri, None, placement)
        source_root = RunRoot(start.run_url)
        source = RunConfig.from_dict(source_root.read_json("config.json"))
        if source.train_hash != start.train_hash:
            raise ConfigError(
                f"model.init_from: the run at {start.run_url} now holds another config (training hash "
                f"{source.train_hash}, {start.train_hash} when this run started from it)"
            )
        # the source's own parts build its policy (its base, its adapters) for the checkpoint to fill
        parts = dataclasses.replace(self, cfg=source, root=source_root, rewards=[], eval_rewards=[])
        with Checkpointer(source_root.uri("checkpoints"), max_to_keep=None) as ckpt:
            graphdef, params = parts.policy_at(ckpt, start.step)
        model = nnx.merge(graphdef, params)
        if source.model.lora is not None:
            model = lora.merge(model)
        return model

    def keep_start(self) -> dict[str, Any] | None:
        """Copy the policy model.init_from resolved to into this run's start/ (outputs first, the
        marker naming the version last), so the run does not depend on the other run's files
        again; its info, or None where there is nothing to copy (no init_from, a copy already)."""
        start = self.cfg.start_point
        if start is None or copy_of(self.root, start) is not None:
            return None
        t = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="grpo-start-") as tmp:
            if start.kind == "export":  # the files as they are: config.json, model.safetensors, ...
                source = RunRoot(start.run_url)
                rel = f"export/{start.step}"
                for name in source.list(rel):
                    if name != RunRoot.MARKER and not name.startswith("."):
                        source.get_file(f"{rel}/{name}", os.path.join(tmp, name))
            else:
                save_hf_model(self._policy_of(start), tmp)  # the source's checkpoint, LoRA merged
            files = sorted(os.listdir(tmp))
            for name in files:
                self.root.put_file(os.path.join(tmp, name), f"{COPY}/{name}")
        info = {"version": start.version, "files": files, "seconds": round(time.perf_counter() - t, 3)}
        self.root.mark_done(COPY, info)  # last: the copy is complete
        return dict(info, uri=self.root.uri(COPY))

    def _load_hf(self, source: str, revision: str | None, placement=None):
        overrides = {k: v for k, v in self.cfg.model.overrides.items() if k in ("dtype", "param_dtype")}
        return load_hf_model(resolve(source, revision), placement=placement, **overrides)

    def _base_policy(self, placement=None, shapes_only: bool = False):
        """model.path's weights or the preset initialised from model.seed; `shapes_only`: its
        parameters' shapes and dtypes, for a checkpoint to fill (nothing read or initialised)."""
        mc = self.model_config()
        if mc.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(
                f"model.vocab_size ({mc.vocab_size}) is smaller than the tokenizer's ({self.tokenizer.vocab_size})"
            )
        if shapes_only:  # the very config load_hf_model builds from model.path's config.json (model_config)
            return nnx.eval_shape(lambda: create_model(mc, self.cfg.model.seed))
        if self.cfg.model_path:
            return self._load_hf(self.cfg.model_path, self.cfg.model.revision, placement)
        return create_model(mc, self.cfg.model.seed)


def _unwrap(tree):
    """Orbax restores an nnx.State without a target as nested dicts whose leaves sit under a
    'value' key (the Variable's field); replace_by_pure_dict wants the arrays themselves."""
    if isinstance(tree, dict):
        if set(tree) == {"value"}:
            return tree["value"]
        return {k: _unwrap(v) for k, v in tree.items()}
    return tree


def open_run(cfg: RunConfig, root: RunRoot) -> RunParts:
    """Everything a stage needs, with the prepared data read from `data/{hash}` of the run root."""
    tokenizer = make_tokenizer(cfg)
    rewards, eval_rewards = config_rewards(cfg)  # with an environment that scores its episodes, its reward
    if cfg.eval.accuracy_reward not in [r.name for r in eval_rewards]:
        raise ConfigError(
            f"eval.accuracy_reward {cfg.eval.accuracy_reward!r} is not one of the eval rewards "
            f"{[r.name for r in eval_rewards]}"
        )
    train_rows, eval_rows = load_prepared(root, cfg.data_hash)
    return RunParts(cfg, root, tokenizer, rewards, eval_rewards, train_rows, eval_rows)
