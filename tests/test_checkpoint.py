import jax
import numpy as np
import pytest

from grpo_core.rl.checkpoint import Checkpointer
from tests.test_trainer import make


def test_resume_continues_exactly(tmp_path):
    """2 steps, checkpoint, a fresh trainer restores and runs 2 more == 4 uninterrupted steps."""
    straight, _ = make(steps=4, optimizer={"learning_rate": 1e-2})
    want = straight.train()

    first, _ = make(steps=4, optimizer={"learning_rate": 1e-2})
    with Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2) as ckpt:
        first.train(num_steps=2)
        first.save(ckpt, config_hash="abc")
        ckpt.wait()
        assert ckpt.latest_step() == 2
        resumed, _ = make(steps=4, optimizer={"learning_rate": 1e-2})
        assert resumed.restore(ckpt, config_hash="abc") and resumed.step == 2
        got = resumed.train()
    assert [int(m["step"]) for m in got] == [2, 3]
    for w, g in zip(want[2:], got):
        for k in ("reward", "loss", "grad_norm", "learning_rate"):
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), k
    assert int(resumed.state["step"]) == int(straight.state["step"]) == 4
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), straight.params, resumed.params)


def test_no_checkpoint_and_foreign_checkpoint(tmp_path):
    tr, _ = make(steps=1)
    with Checkpointer(str(tmp_path / "c")) as ckpt:
        assert not tr.restore(ckpt) and tr.step == 0
        tr.train()
        tr.save(ckpt, config_hash="run-a")
        ckpt.wait()
        other, _ = make(steps=1)
        with pytest.raises(ValueError, match=r"checkpoint 1 in .* was written by another run .*config 'run-a'"):
            other.restore(ckpt, config_hash="run-b")


def test_max_to_keep_and_unfinished_saves_are_invisible(tmp_path):
    tr, _ = make(steps=3)
    d = tmp_path / "c"
    with Checkpointer(str(d), max_to_keep=2) as ckpt:
        for _ in range(3):
            tr.train(num_steps=tr.step + 1)
            tr.save(ckpt)
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3]
    # a half-written checkpoint (Orbax's temporary name, no finalisation) is not "latest"
    (d / "4.orbax-checkpoint-tmp-123").mkdir()
    with Checkpointer(str(d)) as ckpt:
        assert ckpt.latest_step() == 3


def test_epoch_checkpoints_are_kept_besides_the_newest(tmp_path):
    """pipeline.keep_epoch_checkpoints: each epoch's last checkpoint (here 2 and 4) stays, so it can
    be evaluated or exported later; the others go once they are not among the newest 2 (before:
    only the newest 3 of all were kept)."""
    tr, _ = make(steps=6)
    with Checkpointer(str(tmp_path / "c"), max_to_keep=2, keep_steps=[2, 4, 6]) as ckpt:
        for _ in range(6):
            tr.train(num_steps=tr.step + 1)
            tr.save(ckpt)
            ckpt.wait()
        assert ckpt.all_steps() == [2, 4, 5, 6]


def test_the_parameters_alone_are_read_without_the_optimizer_state(tmp_path):
    """Evaluation, export and a run started from this one read `params` only: the same arrays
    as a full restore, and none of Adam's moments (twice the parameters' bytes) leave the disk."""
    tr, _ = make(steps=1)
    tr.train()
    with Checkpointer(str(tmp_path / "c")) as ckpt:
        tr.save(ckpt)
        ckpt.wait()
        full, _ = ckpt.restore(1)
        params, meta = ckpt.restore(1, only="params")
    assert set(full) > {"params"} and set(params) == {"params"} and meta["step"] == 1
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), full["params"], params["params"])
    moments = sum(x.nbytes for k, v in full.items() if k != "params" for x in jax.tree.leaves(v))
    assert moments >= 2 * sum(x.nbytes for x in jax.tree.leaves(params["params"]))  # what is no longer read
