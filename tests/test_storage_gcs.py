"""RunRoot and Orbax checkpoints on gs://, against gcp-storage-emulator on 127.0.0.1."""

import subprocess
import sys

import numpy as np
import pytest

from grpo_core.checkpoint import Checkpointer
from grpo_core.storage import RunRoot


@pytest.fixture
def gs_root(gcs_emulator):
    return RunRoot(gcs_emulator.url_for("runs") + "/r1")


def test_objects_markers_metrics_and_probe(gs_root):
    gs_root.write_json("config.json", {"a": 1})
    assert gs_root.read_json("config.json") == {"a": 1} and gs_root.list("") == ["config.json"]
    gs_root.write_bytes("data/h/train.jsonl", b"{}\n")
    assert not gs_root.is_done("data/h")
    gs_root.mark_done("data/h", {"rows": 1})
    assert gs_root.is_done("data/h") and gs_root.done_info("data/h") == {"rows": 1}
    gs_root.write_metrics([{"step": 0, "reward": 0.1}, {"step": 1, "reward": 0.2}])
    gs_root.write_metrics([{"step": 1, "reward": 0.25}])
    assert [r["reward"] for r in gs_root.read_metrics()] == [0.1, 0.25]
    gs_root.probe()
    with pytest.raises(FileNotFoundError, match=r"gs://grpo-test/.*/r1/nope.json does not exist"):
        gs_root.read_json("nope.json")


def test_orbax_checkpoints_on_gs(gs_root):
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
    url = gs_root.uri("checkpoints")
    with Checkpointer(url, max_to_keep=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {k: v * step for k, v in tree.items()}, {"seed": 0})
            ckpt.wait()
        assert ckpt.latest_step() == 3 and ckpt.all_steps() == [2, 3]
        state, meta = ckpt.restore(3, like=tree)
    np.testing.assert_array_equal(state["w"], tree["w"] * 3)
    assert meta == {"seed": 0, "step": 3}
    code = (f"from grpo_core.checkpoint import Checkpointer\n"
            f"with Checkpointer({url!r}) as c:\n"
            f"    s, m = c.restore(c.latest_step())\n"
            f"print(float(s['w'].sum()), m['step'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(float(tree["w"].sum() * 3)), "3"]
