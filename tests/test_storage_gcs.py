"""RunRoot and Orbax checkpoints on gs://, against fake-gcs-server on 127.0.0.1 (tests/gcs.py)."""

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_core.rl.checkpoint import Checkpointer
from grpo_core.store.root import RunRoot


@pytest.fixture
def gs_root(gcs_emulator):
    return RunRoot(gcs_emulator.url_for("runs") + "/r1")


def test_objects_and_listing(gs_root):
    assert gs_root.url.startswith("gs://grpo-test/runs-") and gs_root.list("") == []
    uri = gs_root.write_json("config.json", {"b": 1, "a": [1, 2]})
    assert uri == f"{gs_root.url}/config.json" and gs_root.read_json("config.json") == {"a": [1, 2], "b": 1}
    gs_root.write_bytes("data/abc/train.bin", b"x" * 10)
    gs_root.write_bytes("data/abc/eval.bin", b"y")
    assert gs_root.read_bytes("data/abc/train.bin") == b"x" * 10 and gs_root.exists("data/abc/eval.bin")
    assert gs_root.list("") == ["config.json", "data"] and gs_root.list("data/abc") == ["eval.bin", "train.bin"]
    assert gs_root.list("nothing") == [] and not gs_root.exists("nothing.json")
    with pytest.raises(FileNotFoundError, match=rf"^{gs_root.url}/missing.json does not exist$"):
        gs_root.read_json("missing.json")


def test_marker_last_metrics_and_probe(gs_root):
    stage = "data/0123abcd"
    gs_root.write_bytes(f"{stage}/train.jsonl", b"{}\n")
    assert not gs_root.is_done(stage)
    gs_root.mark_done(stage, {"rows": 1})
    assert gs_root.is_done(stage) and gs_root.done_info(stage) == {"rows": 1}

    gs_root.write_metrics([{"step": 0, "reward": 0.1}, {"step": 1, "reward": 0.2}])
    gs_root.write_metrics([{"step": 1, "reward": 0.25}, {"step": 2, "reward": 0.3}])  # a retry re-ran step 1
    rows = gs_root.read_metrics()
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["reward"] == 0.25
    assert gs_root.list("metrics") == ["00000000-00000001.jsonl", "00000001-00000002.jsonl"]

    gs_root.probe()
    assert gs_root.list("") == ["data", "metrics"]  # the probe object is gone


def _tree(step):
    return {
        "params": {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) * step, "b": np.full(3, step, np.float32)},
        "opt": {"count": jnp.asarray(step, jnp.int32), "mu": jnp.ones((4,), jnp.bfloat16) * step},
    }


def _assert_tree_equal(got, want):
    got_leaves, want_leaves = sorted(_leaves(got)), sorted(_leaves(want))
    assert [k for k, _ in got_leaves] == [k for k, _ in want_leaves]
    for (k, g), (_, w) in zip(got_leaves, want_leaves):
        assert np.asarray(g).dtype == np.asarray(w).dtype, k
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=k)


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in _leaves(v, f"{prefix}/{k}")]
    return [(prefix, tree)]


def test_orbax_checkpoints(gs_root):
    url = gs_root.uri("checkpoints")
    with Checkpointer(url, max_to_keep=2) as ckpt:
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        for step in (1, 2):
            ckpt.save(step, _tree(step), {"seed": 7, "config_hash": "abc"})
        ckpt.wait()
        assert ckpt.latest_step() == 2 and ckpt.all_steps() == [1, 2]
        state, meta = ckpt.restore(2, like=_tree(0))
        _assert_tree_equal(state, _tree(2))
        assert meta == {"seed": 7, "config_hash": "abc", "step": 2}
        state, _ = ckpt.restore(1)  # as saved: nested dicts of arrays
        _assert_tree_equal(state, _tree(1))

        ckpt.save(3, _tree(3), {"seed": 7})
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3]
    assert gs_root.list("checkpoints") == ["2", "3"]  # step 1 is deleted from the bucket

    # a save cut off before Orbax's commit marker is not a checkpoint
    gs_root.write_bytes("checkpoints/4/state/manifest.ocdbt", b"half")
    with Checkpointer(url) as ckpt:
        assert ckpt.latest_step() == 3 and ckpt.all_steps() == [2, 3]


def test_child_process_restores_what_this_one_saved(gs_root):
    """The pipeline's worker is another process: it finds the emulator through the inherited env."""
    url = gs_root.uri("checkpoints")
    with Checkpointer(url) as ckpt:
        ckpt.save(5, _tree(5), {"seed": 1})
        ckpt.wait()
    gs_root.mark_done("checkpoints/5", {"step": 5})
    code = f"""
import json, numpy as np
from grpo_core.rl.checkpoint import Checkpointer
from grpo_core.store.root import RunRoot
with Checkpointer({url!r}) as c:
    step = c.latest_step()
    state, meta = c.restore(step)
print(json.dumps({{"step": step, "meta": meta, "done": RunRoot({gs_root.url!r}).done_info("checkpoints/5"),
                  "w": np.asarray(state["params"]["w"]).tolist(), "mu": str(state["opt"]["mu"].dtype)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {
        "step": 5,
        "meta": {"seed": 1, "step": 5},
        "done": {"step": 5},
        "w": np.asarray(_tree(5)["params"]["w"]).tolist(),
        "mu": "bfloat16",
    }


def test_binary_objects_keep_every_byte(gs_root):
    """Uploads through gcsfs's multipart form come back byte for byte, whatever they end with."""
    for i, data in enumerate([b"abc\r", b"\r", b"x\r\n", b"\n\n--\r\n", bytes(range(256)), b"\r" * 3 + b"\x00"]):
        gs_root.write_bytes(f"bin/{i}", data)
        assert gs_root.read_bytes(f"bin/{i}") == data, data
