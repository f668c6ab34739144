"""Continual runs: model.init_from resolved to one run and step (a name under storage.root, a
folder, NAME@STEP, or a pattern taking the last finished run), recorded in config.json and the
training hash, refused with a message naming the field when it cannot be used; the starting
policy is that run's checkpoint or export, the KL reference the start or the original base; a
run_name template is filled in once per flow run and read back by its retries."""

import datetime
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from grpo_core.config.run import RunConfig, format_run_name
from grpo_core.errors import ConfigError
from grpo_core.resolve import resolve_run
from grpo_core.store.root import RunRoot
from grpo_core.store.runs import init_run_root
from grpo_core.store.startpoint import StartPoint, policies


def _cfg(root, name, **model) -> RunConfig:
    return RunConfig.from_dict(
        {
            "run_name": name,
            "storage": {"root": str(root)},
            "model": {"preset": "tiny", **model},
            "data": {"eval_rows": 8, "synthetic_rows": 64},
            "train": {
                "num_steps": 4,
                "grpo": {"prompts_per_step": 4, "beta": 0.05},
                "optimizer": {"learning_rate": 1e-2},
            },
            "eval": {"num_samples": 1, "batch_size": 8},
            "pipeline": {"epochs": 1, "checkpoint_every": 2},
        }
    )


def _fake_run(root, name, checkpoints=(), exports=(), **model) -> RunConfig:
    """A run folder as far as resolving goes: config.json, checkpoint folders, export markers."""
    cfg = _cfg(root, name, **model)
    run = init_run_root(cfg)
    for s in checkpoints:
        os.makedirs(f"{cfg.run_url}/checkpoints/{s}")
    for s in exports:
        run.mark_done(f"export/{s}", {"step": s, "train_hash": cfg.train_hash})
    return cfg


def test_a_name_resolves_to_the_newest_policy_an_export_before_a_checkpoint(tmp_path):
    src = _fake_run(tmp_path, "src", checkpoints=[2, 4], exports=[4])
    os.makedirs(f"{src.run_url}/checkpoints/6.orbax-checkpoint-tmp-1")  # a save in progress: not a policy
    assert policies(RunRoot(src.run_url)) == {2: "checkpoint", 4: "export"}
    cfg = resolve_run(_cfg(tmp_path, "next", init_from="src"))
    assert cfg.start_point == StartPoint(src.run_url, 4, "export", src.train_hash)
    assert dict(cfg.versions)["model.init_from"] == f"{src.run_url}@4:export:{src.train_hash}"
    # a given step, and the run named by its folder
    at2 = resolve_run(_cfg(tmp_path, "next2", init_from=f"{src.run_url}@2"))
    assert at2.start_point == StartPoint(src.run_url, 2, "checkpoint", src.train_hash)
    assert at2.start_point.uri == f"{src.run_url}/checkpoints/2"
    # the start is part of the training hash (not of the data's); config.json records it
    assert at2.train_hash != cfg.train_hash and at2.data_hash == cfg.data_hash
    init_run_root(cfg)
    assert (
        RunRoot(cfg.run_url)
        .read_json("config.json")["versions"]["model.init_from"]
        .endswith(":export:" + src.train_hash)
    )
    # the same config without init_from hashes as before the field existed
    assert "init_from" not in _cfg(tmp_path, "x").model.to_dict()


def test_what_cannot_be_started_from_is_refused_naming_the_field(tmp_path):
    _fake_run(tmp_path, "src", checkpoints=[2, 4])
    _fake_run(tmp_path, "empty")
    _fake_run(tmp_path, "wide", checkpoints=[4], hidden_size=96)
    cases = {
        "nowhere": r"model\.init_from 'nowhere'.*is not a run \(no config\.json there\)",
        "empty": r"model\.init_from 'empty': the run at .*/empty has no finalised checkpoint or export yet",
        "src@3": r"model\.init_from 'src@3': .* no checkpoint or export of step 3; it has steps \[2, 4\]",
        "wide": r"model\.init_from 'wide': the run at .*/wide trained another model \(hidden_size 96 there, 128 here\)",
        "next": r"model\.init_from 'next' is this run itself",
        "src-*@2": r"a pattern takes each run's last step, not @2",
    }
    _fake_run(tmp_path, "next", checkpoints=[2])
    for ref, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            resolve_run(_cfg(tmp_path, "next", init_from=ref))
    with pytest.raises(ConfigError, match=r"model\.reference: base differs from start only when model\.init_from"):
        _cfg(tmp_path, "x", reference="base")
    with pytest.raises(ConfigError, match=r"model\.reference"):
        _cfg(tmp_path, "x", init_from="src", reference="newest")


def test_a_pattern_takes_the_last_finished_run_and_never_this_one(tmp_path):
    _fake_run(tmp_path, "nightly-2026-11-20", checkpoints=[2, 4])  # finished: a policy at num_steps (4)
    _fake_run(tmp_path, "nightly-2026-11-21", exports=[4])
    _fake_run(tmp_path, "nightly-2026-11-22", checkpoints=[2])  # preempted, never finished
    _fake_run(tmp_path, "other-2026-11-23", checkpoints=[4])
    cfg = resolve_run(_cfg(tmp_path, "nightly-2026-11-23", init_from="nightly-*"))
    assert cfg.start_point.run_url.endswith("/nightly-2026-11-21") and cfg.start_point.kind == "export"
    # the night's own run, finished, is not its own start: a re-run resolves as the first run did
    _fake_run(tmp_path, "nightly-2026-11-23", init_from="nightly-*", exports=[4])
    again = resolve_run(_cfg(tmp_path, "nightly-2026-11-23", init_from="nightly-*"))
    assert again.start_point == cfg.start_point
    # the first night of a chain: nothing finished matches yet, so the base model, said once
    _fake_run(tmp_path, "weekly-1", checkpoints=[2])
    said = []
    first = resolve_run(_cfg(tmp_path, "weekly-2", init_from="weekly-*"), warn=said.append)
    assert first.start_point is None and dict(first.versions)["model.init_from"].startswith("base:")
    assert said == [
        f"model.init_from 'weekly-*': no finished run under {tmp_path} matches it (matching, not finished: "
        "weekly-1); this run starts from the base model (model.path or the preset)"
    ]


def test_run_name_templates():
    when = datetime.datetime(2026, 11, 24, 2, 0, 5, tzinfo=datetime.timezone.utc)
    assert format_run_name("nightly-{date}", when) == "nightly-2026-11-24"
    assert format_run_name("n-{datetime}", when) == "n-2026-11-24-020005"
    assert format_run_name("n-{date}-{time}", when.astimezone(datetime.timezone(datetime.timedelta(hours=9)))) == (
        "n-2026-11-24-020005"  # always UTC
    )
    with pytest.raises(
        ConfigError,
        match=r"run_name 'n-\{day\}': placeholders must be \{date\}, \{time\}, \{datetime\} .*got '\{day\}'",
    ):
        RunConfig.from_dict({"run_name": "n-{day}"})
    with pytest.raises(
        ConfigError, match=r"run_name 'n-\{date' is not a valid format string: expected '\}' before end of string"
    ):
        RunConfig.from_dict({"run_name": "n-{date"})
    cfg = RunConfig.from_dict({"run_name": "nightly-{date}"})
    with pytest.raises(ConfigError, match=r"run_name 'nightly-\{date\}' is a template"):
        cfg.run_url
    assert cfg.with_run_name(when).run_url.endswith("/nightly-2026-11-24")


def _same(a, b) -> bool:
    la, lb = jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.mark.slow
@pytest.mark.parametrize("source_lora", [False, True], ids=["full", "lora-source"])
def test_the_start_is_the_source_policy_and_the_reference_as_configured(tmp_path, source_lora):
    """A real source run (the worker's own training, export); a continual run's starting policy
    is that run's checkpoint or export exactly (LoRA merged), its trainer's KL reference the
    start (default) or the untrained base; it trains on from there."""
    from grpo_core.data.prepare import prepare_dataset
    from grpo_core.data.tokenizer import make_tokenizer
    from grpo_core.rl.checkpoint import Checkpointer
    from grpo_core.rl.trainer import GRPOTrainer
    from grpo_core.stages import worker
    from grpo_core.stages.parts import open_run
    from grpo_core.store.report import build_summary

    lora = {"lora": {"rank": 4, "alpha": 8}} if source_lora else {}
    src = resolve_run(_cfg(tmp_path, "src", **lora))
    root = init_run_root(src)
    prepare_dataset(src.data, make_tokenizer(src), root, src.tokenizer_id)
    parts = open_run(src, root)
    assert worker.train(parts, 4) == 0 and worker.export(parts, 4) == 0
    with Checkpointer(root.uri("checkpoints"), max_to_keep=None) as ckpt:
        trained = {s: nnx.merge(*parts.policy_at(ckpt, s)) for s in (2, 4)}
    if source_lora:
        from grpo_core.nn.lora import merge

        trained = {s: merge(m) for s, m in trained.items()}

    def continual(name, ref, **model):
        cfg = resolve_run(_cfg(tmp_path, name, init_from=ref, **model))
        run = init_run_root(cfg)
        prepare_dataset(cfg.data, make_tokenizer(cfg), run, cfg.tokenizer_id)
        return cfg, open_run(cfg, run)

    cfg, nxt = continual("from-export", "src")  # step 4: the export
    assert cfg.start_point.kind == "export" and cfg.start_point.step == 4
    start = nxt.create_policy()
    assert _close(start, trained[4])
    assert nxt.reference_policy() is None  # the reference is the start
    # from a checkpoint, with the original base as the KL reference (and, after a LoRA source,
    # fresh adapters of its own over the merged start)
    cfg2, at2 = continual("from-ckpt", "src@2", reference="base", **lora)
    assert cfg2.start_point.kind == "checkpoint"
    policy = at2.create_policy()
    if source_lora:
        from grpo_core.nn.lora import has_adapters, merge

        assert has_adapters(policy)
        policy = merge(policy)  # adapters start at zero: the merged start is the source's policy
    assert _close(policy, trained[2])
    reference = at2.reference_policy()
    assert _same(reference, _untrained(at2)) and not _same(reference, trained[2])
    trainer = GRPOTrainer(
        at2.create_policy(),
        cfg2.train,
        at2.tokenizer,
        at2.rewards,
        _prompts(at2),
        reference=reference,
    )
    ref_leaves = jax.tree.leaves(trainer.ref_params)
    assert all(
        np.array_equal(np.asarray(r), np.asarray(b)) for r, b in zip(ref_leaves, jax.tree.leaves(nnx.state(reference)))
    )
    trainer.close()
    # it trains on from there, and says where it started
    assert worker.train(at2, 2) == 0
    s = build_summary(at2.root, "completed")
    assert s["started_from"] == {
        "run": src.run_url,
        "step": 2,
        "kind": "checkpoint",
        "uri": f"{src.run_url}/checkpoints/2",
    }
    # its first training copied the start into the run (start/, the marker naming the version), so
    # deleting the source loses nothing: the start and the re-resolved config are the same, and it resumes
    assert at2.root.done_info("start")["version"] == cfg2.start_point.version
    assert worker.train(nxt, 2) == 0  # an export's files are copied as they are
    assert {"_SUCCESS", "config.json", "model.safetensors"} <= set(nxt.root.list("start"))
    _, never = continual("never", "src")
    shutil.rmtree(src.run_url)
    assert _close(nxt.create_policy(), trained[4])
    again = resolve_run(_cfg(tmp_path, "from-ckpt", init_from="src@2", reference="base", **lora))
    assert again.train_hash == cfg2.train_hash and again.start_point == cfg2.start_point
    resumed = open_run(again, at2.root)
    policy = resumed.create_policy()
    assert _close(merge(policy) if source_lora else policy, trained[2])
    assert worker.train(resumed, 4) == 0 and len(at2.root.read_metrics()) == 4
    # a run that never trained holds no copy: refused naming the field, as is re-resolving its config
    with pytest.raises(ConfigError, match=r"model\.init_from 'src': the policy this run starts from .* is gone"):
        never.create_policy()
    with pytest.raises(ConfigError, match=r"is not a run .*no run of this config .* holds a copy"):
        resolve_run(_cfg(tmp_path, "never", init_from="src"))


def _close(a, b) -> bool:
    """An export is written as safetensors and read back: the same float32 values (LoRA: merged
    once on export, once here, in the same float32 arithmetic)."""
    la, lb = jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))
    return len(la) == len(lb) and all(
        np.allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7) for x, y in zip(la, lb)
    )


def _untrained(parts):
    from grpo_core.nn.model import create_model

    return create_model(parts.model_config(), 0)  # the preset at model.seed 0, as the source run began


def _prompts(parts):
    from grpo_core.data.prepare import DatasetPrompts

    return DatasetPrompts(parts.train_rows, seed=parts.cfg.data.seed)
