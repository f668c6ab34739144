"""A damaged newest checkpoint: resuming sets it aside (moved, never deleted), says so naming the
folder, and continues from the newest checkpoint that restores, to the same parameters as a run
never interrupted. An explicit request (evaluation, export) names the folder and moves nothing.
Real Orbax on real files: local folders, gs:// on the emulator, the worker process, two
processes, and the Prefect task's log."""

import json
import logging
import os
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_core.errors import ExitCode, classify
from grpo_core.rl.checkpoint import SET_ASIDE, Checkpointer, UnreadableCheckpointError
from grpo_core.store.report import latest_checkpoint
from grpo_core.store.root import RunRoot
from tests.test_trainer import make

HASH = "cfg-a"
LR = {"learning_rate": 1e-2}  # large enough that every step moves the parameters


def truncate_largest(step_dir: Path) -> str:
    """Cut the largest file under the checkpoint's state/ in half (an array's data: a restore
    reads it, where a small index file may never be read)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    big = max(files, key=lambda p: p.stat().st_size)
    os.truncate(big, big.stat().st_size // 2)
    return "OUT_OF_RANGE"  # what TensorStore says about it (its own first line, not the spec dump)


def delete_metadata(step_dir: Path) -> str:
    (step_dir / "state" / "_METADATA").unlink()
    return "_METADATA"


DAMAGE = {"truncated": truncate_largest, "no_metadata": delete_metadata}


def files_of(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_same_params(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run folder with checkpoints 1, 2 and 3 of a 4-step run, and the parameters that run
    reaches at step 4 trained straight through (saving changes nothing): what a resume must reach."""
    run = tmp_path_factory.mktemp("saved") / "run"
    tr, _ = make(steps=4, optimizer=LR)
    with Checkpointer(str(run / "checkpoints"), max_to_keep=3) as ckpt:
        for step in (1, 2, 3):
            tr.train(num_steps=step)
            tr.save(ckpt, config_hash=HASH)
            ckpt.wait()
    tr.train()
    return run, jax.device_get(tr.params)


@pytest.fixture
def run(saved, tmp_path):
    """A fresh copy of the saved run folder."""
    shutil.copytree(saved[0], tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_sets_a_damaged_newest_checkpoint_aside_and_continues_exactly(saved, run, damage):
    ckpts = run / "checkpoints"
    said = DAMAGE[damage](ckpts / "3")
    damaged = files_of(ckpts / "3")
    seen = []
    resumed, _ = make(steps=4, optimizer=LR)
    with Checkpointer(str(ckpts), max_to_keep=3) as ckpt:
        assert resumed.restore(ckpt, config_hash=HASH, on_set_aside=seen.append)
        assert resumed.step == 2 and int(resumed.state["step"]) == 2

        [aside] = seen
        uri, moved = str(ckpts / "3"), Path(aside.moved_to)
        assert (aside.step, aside.uri, aside.next_step) == (3, uri, 2)
        assert moved.parent == ckpts / SET_ASIDE and re.fullmatch(r"3-\d{8}T\d{6}Z", moved.name)
        assert not (ckpts / "3").exists() and files_of(moved) == damaged  # moved whole, every byte kept
        assert aside.error.startswith(f"checkpoint 3 at {uri} could not be restored: ") and said in aside.reason
        assert aside.message == (
            f"checkpoint 3 at {uri} could not be restored ({aside.reason}): set aside as {moved}; "
            "falling back to checkpoint 2"
        )
        assert "'driver'" not in aside.error and len(aside.reason) <= 300  # no TensorStore spec dump
        event = aside.as_event()
        assert {k: event[k] for k in ("step", "uri", "moved_to", "next_step")} == {
            "step": 3,
            "uri": uri,
            "moved_to": str(moved),
            "next_step": 2,
        }
        json.dumps(event)  # a JSON line as it is

        # Neither reader of the folder takes the set-aside one for a step.
        assert ckpt.all_steps() == [1, 2] and latest_checkpoint(RunRoot(str(run))) == 2

        # Train on; checkpoint 3 is written afresh under its own number, the set-aside one stays.
        resumed.train(num_steps=3)
        resumed.save(ckpt, config_hash=HASH)
        ckpt.wait()
        resumed.train()
        resumed.save(ckpt, config_hash=HASH)
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3, 4] and latest_checkpoint(RunRoot(str(run))) == 4
        assert files_of(moved) == damaged
    assert_same_params(saved[1], resumed.params)

    # A later resume restores the new 4 and sets nothing aside.
    again, _ = make(steps=4, optimizer=LR)
    with Checkpointer(str(ckpts)) as ckpt:
        assert again.restore(ckpt, config_hash=HASH, on_set_aside=seen.append) and again.step == 4
    assert len(seen) == 1 and os.listdir(ckpts / SET_ASIDE) == [moved.name]


def test_every_checkpoint_damaged_starts_from_step_zero_saying_so(run):
    ckpts = run / "checkpoints"
    for step in (1, 2, 3):
        delete_metadata(ckpts / str(step))
    seen = []
    tr, _ = make(steps=4, optimizer=LR)
    with Checkpointer(str(ckpts)) as ckpt:
        assert not tr.restore(ckpt, config_hash=HASH, on_set_aside=seen.append) and tr.step == 0
        assert ckpt.all_steps() == []
    assert [(a.step, a.next_step) for a in seen] == [(3, 2), (2, 1), (1, None)]
    assert seen[-1].message.endswith("no older checkpoint is left: training starts again from step 0")
    assert sorted(n.split("-")[0] for n in os.listdir(ckpts / SET_ASIDE)) == ["1", "2", "3"]
    assert latest_checkpoint(RunRoot(str(run))) is None


def shapes_trainer(steps=4):
    """A trainer whose policy is shapes only (nnx.eval_shape), as a resuming worker builds it:
    a checkpoint, or start_from, fills its state."""
    from flax import nnx

    from grpo_core.rl.trainer import GRPOTrainer

    _, run = make(steps=steps, optimizer=LR)
    shapes = nnx.eval_shape(lambda: run.model)
    return GRPOTrainer(shapes, run.train, run.tokenizer, run.rewards, run.task), run


def test_a_trainer_built_from_shapes_resumes_to_the_same_parameters(saved, run):
    """Resuming, the policy need not be built first: its state is restored into shapes, and
    training on reaches what the uninterrupted run reached; before a restore it refuses to train."""
    _, final = saved
    tr, _ = shapes_trainer()
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tr.state))
    with pytest.raises(RuntimeError, match="built from shapes: restore a checkpoint, or start_from a model, first"):
        tr.train_step()
    with Checkpointer(str(run / "checkpoints")) as ckpt:
        assert tr.restore(ckpt, config_hash=HASH) and tr.step == 3
    tr.train()
    assert_same_params(final, tr.params)


def test_a_trainer_built_from_shapes_with_every_checkpoint_damaged_starts_from_its_model(run):
    """Every checkpoint set aside, a trainer built from shapes starts from the built policy at step
    0 (start_from) and trains as a trainer built from it does."""
    for step in (1, 2, 3):
        delete_metadata(run / "checkpoints" / str(step))
    tr, built = shapes_trainer(steps=1)
    with Checkpointer(str(run / "checkpoints")) as ckpt:
        assert not tr.restore(ckpt, config_hash=HASH)
    tr.start_from(built.model)
    fresh, _ = make(steps=1, optimizer=LR)
    tr.train(), fresh.train()
    assert tr.step == fresh.step == 1
    assert_same_params(fresh.params, tr.params)


def test_a_trainer_built_from_shapes_needs_the_model_for_lora_or_a_reference():
    from flax import nnx

    from grpo_core.rl.trainer import GRPOTrainer

    _, run = make(steps=1, grpo={"beta": 0.04})
    with pytest.raises(ValueError, match="with LoRA .* or a KL reference .* it needs the built model"):
        GRPOTrainer(nnx.eval_shape(lambda: run.model), run.train, run.tokenizer, run.rewards, run.task)


def test_another_runs_checkpoint_is_refused_not_moved_even_when_damaged(run):
    ckpts = run / "checkpoints"
    truncate_largest(ckpts / "3")
    tr, _ = make(steps=4, optimizer=LR)
    with Checkpointer(str(ckpts)) as ckpt:
        with pytest.raises(ValueError, match=r"checkpoint 3 in .* was written by another run .*config 'cfg-a'"):
            tr.restore(ckpt, config_hash="cfg-b", on_set_aside=pytest.fail)
        assert ckpt.all_steps() == [1, 2, 3]
    assert not (ckpts / SET_ASIDE).exists()


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_an_explicit_step_that_fails_names_its_folder_and_moves_nothing(run, damage):
    ckpts = run / "checkpoints"
    said = DAMAGE[damage](ckpts / "3")
    before = files_of(ckpts / "3")
    tr, _ = make(steps=4, optimizer=LR)
    uri = re.escape(str(ckpts / "3"))
    with Checkpointer(str(ckpts), max_to_keep=None) as ckpt:
        with pytest.raises(UnreadableCheckpointError, match=rf"^checkpoint 3 at {uri} could not be restored: ") as err:
            ckpt.restore(3)  # as evaluation and export restore it: as saved
        assert said in str(err.value) and "'driver'" not in str(err.value)
        assert classify(err.value).code == ExitCode.STORAGE  # the worker's error event names the folder
        with pytest.raises(UnreadableCheckpointError, match=rf"^checkpoint 3 at {uri} could not be restored: "):
            tr.restore(ckpt, step=3, config_hash=HASH)
        assert ckpt.all_steps() == [1, 2, 3]
    assert files_of(ckpts / "3") == before and not (ckpts / SET_ASIDE).exists()


# -- gs:// -----------------------------------------------------------------------------------


def _tree(step):
    # 16 KiB of weights: larger than OCDBT stores inline, so they live in a data object of their own
    return {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64) * step, "count": jnp.asarray(step, jnp.int32)}


@pytest.mark.parametrize("damage", ["truncated", "no_manifest"])
def test_on_gcs_the_damaged_folder_is_copied_aside_and_deleted(gcs_emulator, damage):
    root = RunRoot(gcs_emulator.url_for("runs") + "/r1")
    url = root.uri("checkpoints")
    with Checkpointer(url) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _tree(step), {"seed": 0})
        ckpt.wait()
    fs, state = root.fs, f"{root.path}/checkpoints/3/state"
    if damage == "truncated":  # the largest array data object
        sizes = fs.find(f"{state}/ocdbt.process_0/d", detail=True)
        big = max(sizes, key=lambda p: sizes[p]["size"])
        fs.pipe_file(big, fs.cat_file(big)[: sizes[big]["size"] // 2])
    else:  # (restoring into a plain dict of arrays, Orbax does not need state/_METADATA)
        fs.rm_file(f"{state}/manifest.ocdbt")
    before = {p.split("/checkpoints/3/", 1)[1] for p in fs.find(f"{root.path}/checkpoints/3")}

    seen = []
    with Checkpointer(url) as ckpt:
        step, got, meta = ckpt.restore_newest(_tree(0), on_set_aside=seen.append)
        assert (step, meta["step"]) == (2, 2)
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(_tree(2)["w"]))
        [aside] = seen
        assert aside.uri == f"{url}/3" and aside.moved_to.startswith(f"{url}/{SET_ASIDE}/3-")
        assert aside.error.startswith(f"checkpoint 3 at {url}/3 could not be restored: ")
        assert "tensorstore_spec" not in aside.error and "'driver'" not in aside.error
        assert ckpt.all_steps() == [1, 2]
    moved = aside.moved_to.split("/checkpoints/", 1)[1]
    assert {p.split(f"/{moved}/", 1)[1] for p in fs.find(f"{root.path}/checkpoints/{moved}")} == before
    assert not fs.exists(f"{root.path}/checkpoints/3")
    assert latest_checkpoint(root) == 2
    with Checkpointer(url) as ckpt:  # a fresh manager lists the bucket again: still not a step
        assert ckpt.all_steps() == [1, 2]
        ckpt.save(3, _tree(3), {"seed": 0})  # the number is free again (no stale listing says otherwise)
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2, 3]
    assert fs.exists(f"{root.path}/checkpoints/{moved}/state")


# -- through the worker process, two processes, and the Prefect task -------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run trained by the worker to step 4 (checkpoints 2 and 4; 6 steps in three epochs)."""
    from tests.test_worker import events, make_run, worker

    root = make_run(str(tmp_path_factory.mktemp("runs")), "trained", pipeline={"checkpoint_every": 2, "epochs": 3})
    assert events(worker(root, 4))[-1] == {"event": "done", "step": 4, "steps_run": 4}
    return Path(root)


def truncate_data(step_dir: Path) -> str:
    """Cut every data file each process wrote under the checkpoint's state/ (ocdbt.process_*/d/)
    to its first 16 bytes. Which arrays share a data file, in what order, and how large each file
    is, are TensorStore's choice from one save to the next: a cut that keeps half a file, or spares
    the smaller files, may keep every parameter whole, and a reader of the parameters alone
    (evaluation, export) then restores fine. Each of the model's matrices is stored out of line
    (over 1 KiB) and ends past 16 bytes."""
    for p in (step_dir / "state").glob("ocdbt.process_*/d/*"):
        os.truncate(p, min(16, p.stat().st_size))
    return "OUT_OF_RANGE"


def copy_run(trained: Path, tmp_path: Path) -> Path:
    """The trained run's folder under another path (the worker and the task take the run from
    --root / the URL they are given), its newest checkpoint (4) damaged."""
    run = tmp_path / trained.name
    shutil.copytree(trained, run)
    truncate_data(run / "checkpoints" / "4")
    return run


@pytest.mark.slow
def test_worker_eval_names_the_folder_and_train_sets_it_aside(trained, tmp_path):
    from tests.test_worker import events, worker

    run = copy_run(trained, tmp_path)
    ckpts = run / "checkpoints"
    proc = worker(str(run), steps="4")  # explicit: an error naming the folder, nothing moved
    out, err = proc.communicate(timeout=300)
    last = json.loads(out.splitlines()[-1])
    assert proc.returncode == ExitCode.STORAGE and last["kind"] == "storage", err[-3000:]
    assert last["message"].startswith(f"checkpoint 4 at {ckpts / '4'} could not be restored: OUT_OF_RANGE")
    assert "'driver'" not in last["message"] and (ckpts / "4").exists() and not (ckpts / SET_ASIDE).exists()

    ev = events(worker(str(run), 6))  # resume: set aside, then from 2
    aside = ev[0]
    assert aside["event"] == "checkpoint_set_aside" and (aside["step"], aside["next_step"]) == (4, 2)
    assert aside["uri"] == str(ckpts / "4") and aside["moved_to"].startswith(f"{ckpts / SET_ASIDE}/4-")
    assert aside["error"].startswith(f"checkpoint 4 at {ckpts / '4'} could not be restored: OUT_OF_RANGE")
    assert aside["message"].endswith(f"set aside as {aside['moved_to']}; falling back to checkpoint 2")
    assert ev[1] == {"event": "resumed", "step": 2, "until": 6}
    assert [e["step"] for e in ev if e["event"] == "step"] == [2, 3, 4, 5]
    assert ev[-1] == {"event": "done", "step": 6, "steps_run": 4}
    assert os.listdir(ckpts / SET_ASIDE / aside["moved_to"].rsplit("/", 1)[1] / "state")
    assert [r["step"] for r in RunRoot(str(run)).read_metrics()] == list(range(6))  # none missing, none doubled


@pytest.mark.slow
def test_two_processes_agree_and_only_process_0_moves(trained, tmp_path):
    from tests.test_multihost import _train  # the multiprocess launcher: 2 processes, CPU devices, gloo

    run = copy_run(trained, tmp_path)
    ev = [e for e in _train(str(run), 6, on_event=lambda e: None) if e["event"] != "memory"]
    assert [e["event"] for e in ev[:2]] == ["checkpoint_set_aside", "resumed"]
    assert (ev[0]["step"], ev[0]["next_step"], ev[1]["step"]) == (4, 2, 2)
    assert ev[-1] == {"event": "done", "step": 6, "steps_run": 4}
    assert len(os.listdir(run / "checkpoints" / SET_ASIDE)) == 1  # one move, by process 0


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_the_train_task_logs_which_checkpoint_was_set_aside(trained, tmp_path):
    from tasks.stages import train_epoch

    run = copy_run(trained, tmp_path)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    task_log = logging.getLogger("prefect.task_runs")
    task_log.addHandler(handler)
    try:
        info = train_epoch(str(run), 2)  # steps 4..6, from checkpoint 2 once 4 is set aside
    finally:
        task_log.removeHandler(handler)
    assert info["step"] == 6 and info["steps_run"] == 4
    [warning] = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    ckpts = run / "checkpoints"
    assert re.fullmatch(
        rf"epoch 2: checkpoint 4 at {re.escape(str(ckpts / '4'))} could not be restored \(OUT_OF_RANGE: .*\): "
        rf"set aside as {re.escape(str(ckpts / SET_ASIDE))}/4-\d{{8}}T\d{{6}}Z; falling back to checkpoint 2",
        warning,
    )
    assert any("resumed at step 2" in r.getMessage() for r in records)
