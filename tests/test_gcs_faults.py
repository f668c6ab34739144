"""What real buckets do that emulators rarely show, through tests.gcs.GcsProxy in front of
fake-gcs-server: 503 and 429 answers and connections dropped in the middle of an upload (each
retried by gcsfs or TensorStore with backoff: nothing is lost or written twice), an upload larger
than one resumable-upload chunk, object names with spaces and non-ASCII letters, and a bucket
these credentials may read but not write. (A whole two-epoch run at 10 % injected faults:
`python -m bench.gcs_faults`.)"""

import hashlib

import numpy as np
import pytest

from grpo_core.errors import StorageError
from grpo_core.store.lease import LeaseHeld, RunLease
from grpo_core.store.root import RunRoot

RATE = 0.1


def test_run_root_objects_and_metrics_survive_injected_faults(gcs_faults):
    gcs_faults.error_rate = RATE
    root = RunRoot(gcs_faults.url_for("runs") + "/r")
    for first in range(0, 120, 10):
        root.write_metrics([{"step": s, "reward": s / 10} for s in range(first, first + 10)])
        root.write_json(f"eval/{first}.json", {"step": first})
    assert [m["step"] for m in root.read_metrics()] == list(range(120))
    assert sorted(root.list("eval"), key=lambda n: int(n[:-5])) == [f"{s}.json" for s in range(0, 120, 10)]
    assert sum(gcs_faults.injected.values()) > 0  # the faults were there, and retried


def test_an_upload_of_two_resumable_chunks_through_faults_keeps_every_byte(gcs_faults, tmp_path):
    """gcsfs uploads a file of 5 MiB or more as a resumable upload in 50 MiB chunks: this one has two,
    and a dropped or refused chunk is sent again at its offset."""
    data = np.random.default_rng(0).bytes(52 * 2**20)
    src = tmp_path / "big.safetensors"
    src.write_bytes(data)
    gcs_faults.error_rate = RATE
    root = RunRoot(gcs_faults.url_for("runs") + "/big")
    root.put_file(str(src), "export/4/model.safetensors")
    gcs_faults.error_rate = 0.0
    assert hashlib.sha256(root.read_bytes("export/4/model.safetensors")).digest() == hashlib.sha256(data).digest()


def test_a_checkpoint_through_faults_restores_exactly(gcs_faults):
    from grpo_core.rl.checkpoint import Checkpointer

    tree = {"w": np.arange(3 * 2**20, dtype=np.float32).reshape(3, 2**20), "b": np.ones(7, np.float32)}  # 12 MiB
    gcs_faults.error_rate = RATE
    url = RunRoot(gcs_faults.url_for("runs") + "/ckpt").uri("checkpoints")
    with Checkpointer(url) as ckpt:
        ckpt.save(1, tree, {"seed": 0})
        ckpt.wait()
    with Checkpointer(url) as ckpt:
        assert ckpt.latest_step() == 1
        back = ckpt.restore(1, {k: np.zeros_like(v) for k, v in tree.items()})[0]
    np.testing.assert_array_equal(np.asarray(back["w"]), tree["w"])
    assert sum(gcs_faults.injected.values()) > 0


def test_the_lease_holds_through_faults(gcs_faults):
    gcs_faults.error_rate = 0.2
    url = gcs_faults.url_for("runs") + "/leased"
    lease = RunLease(url, ttl_s=30, flow_run_id="f1").acquire()
    for _ in range(10):
        lease.renew()
    other = RunLease(url, ttl_s=30, flow_run_id="f2")
    with pytest.raises(LeaseHeld):
        other.acquire()
    assert lease.release() is True and RunLease(url, ttl_s=30, flow_run_id="f3").acquire().release() is True


@pytest.mark.parametrize("name", ["my run", "run é 漢字"])
def test_names_with_spaces_and_unicode(gcs_emulator, name):
    from grpo_core.rl.checkpoint import Checkpointer

    root = RunRoot(f"{gcs_emulator.url_for('runs')}/{name}")
    root.write_json("config.json", {"run": name})
    root.write_metrics([{"step": 0, "reward": 1.0}])
    assert root.read_json("config.json") == {"run": name} and root.list("") == ["config.json", "metrics"]
    with Checkpointer(root.uri("checkpoints")) as ckpt:
        ckpt.save(3, {"w": np.ones(4, np.float32)}, {"seed": 0})
        ckpt.wait()
    with Checkpointer(root.uri("checkpoints")) as ckpt:
        assert ckpt.latest_step() == 3
        assert float(np.asarray(ckpt.restore(3, {"w": np.zeros(4, np.float32)})[0]["w"]).sum()) == 4.0


def test_a_bucket_we_may_read_but_not_write(gcs_faults):
    root = RunRoot(gcs_faults.url_for("runs") + "/ro")
    root.write_json("config.json", {})
    gcs_faults.read_only = True
    assert root.read_json("config.json") == {}
    with pytest.raises(StorageError, match="permission denied") as err:
        root.probe()
    assert root.url in str(err.value) and "may write" in str(err.value)
