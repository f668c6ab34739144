"""Temporary files are cleaned on every exit path (issue 28, item 6): a failed write removes its
temporary file, a re-run removes the stale ones of its own run root, the training worker deletes
the unfinished Orbax saves a killed worker left."""

import os
import subprocess
import sys
import time

import pytest

from grpo_core.store.root import RunRoot, remove_stale_temp
from tests.test_storage_faults import _mount_ns


def _temps(folder) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".tmp-" in p.name)


@pytest.mark.skipif(not _mount_ns(), reason="needs mount namespaces and tmpfs (unshare -m, root)")
def test_a_write_to_a_full_disk_leaves_no_temporary_file(tmp_path):
    """Before: zero-byte config.json.tmp-* files after a full disk."""
    disk, src = tmp_path / "disk", tmp_path / "src.bin"
    disk.mkdir()
    src.write_bytes(b"1" * 200_000)
    code = (
        "import os\n"
        "from grpo_core.store.root import RunRoot\n"
        f"root = RunRoot('{disk}/r')\n"
        "root.write_json('config.json', {'a': 1})\n"
        "for write in (lambda: root.write_bytes('big.json', b'0' * 200_000),"
        f" lambda: root.put_file('{src}', 'big.bin')):\n"
        "    try:\n"
        "        write()\n"
        "    except Exception as exc:\n"
        "        print(type(exc).__name__, exc)\n"
        f"print(sorted(os.listdir('{disk}/r')))\n"
    )
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=64k tmpfs {disk} && {sys.executable} -c "$CODE"'],
        capture_output=True,
        text=True,
        env=dict(os.environ, CODE=code),
        timeout=120,
    )
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 3, (out.stdout, out.stderr[-2000:])
    assert all(x.startswith("StorageError cannot write") and "no space left" in x.lower() for x in lines[:2]), lines
    assert lines[2] == "['config.json']"


def test_a_rerun_removes_stale_temporary_files_of_its_run_root(tmp_path):
    root = RunRoot(str(tmp_path / "r"))
    root.write_json("config.json", {"a": 1})
    old = time.time() - 3600
    names = [
        "config.json.tmp-0a1b2c3d",
        "export/40/generation_config.json.tmp-deadbeef",
        "metrics/x.jsonl.tmp-00ff00ff",
    ]
    for name in names:
        p = tmp_path / "r" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
        os.utime(p, (old, old))
    (tmp_path / "r" / "fresh.json.tmp-12345678").write_bytes(b"")  # a write in flight beside the run
    (tmp_path / "r" / "notes.tmp-old").write_bytes(b"")  # not a name write_bytes makes
    os.utime(tmp_path / "r" / "notes.tmp-old", (old, old))
    removed = remove_stale_temp(root)
    assert sorted(os.path.relpath(p, tmp_path / "r") for p in removed) == sorted(names)
    assert _temps(tmp_path) == ["fresh.json.tmp-12345678", "notes.tmp-old"]
    assert root.read_json("config.json") == {"a": 1}
    assert remove_stale_temp(RunRoot("memory://nothing/here")) == []


def test_the_training_writer_deletes_unfinished_saves_a_reader_does_not(tmp_path):
    import jax.numpy as jnp

    from grpo_core.rl.checkpoint import Checkpointer

    folder = tmp_path / "checkpoints"
    with Checkpointer(str(folder)) as ckpt:
        ckpt.save(1, {"w": jnp.ones(3)}, {})
    (folder / "2.orbax-checkpoint-tmp" / "state").mkdir(parents=True)  # a save killed half-way
    with Checkpointer(str(folder), max_to_keep=None) as reader:
        assert reader.latest_step() == 1
    assert (folder / "2.orbax-checkpoint-tmp").exists()
    with Checkpointer(str(folder), cleanup_tmp=True) as writer:
        assert writer.latest_step() == 1
    assert sorted(p.name for p in folder.iterdir()) == ["1"]


def test_a_killed_exports_staging_folder_is_removed_by_the_next(tmp_path):
    """Before: a 1.2 MB grpo-export-* copy stayed in the system temp folder after a killed export."""
    from grpo_core.stages.worker import remove_dead_staging

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that is gone
    for name in (f"grpo-export-{dead.pid}-abc", f"grpo-export-{os.getpid()}-def", "grpo-export-xyz", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"0" * 100)
    assert remove_dead_staging(str(tmp_path)) == [str(tmp_path / f"grpo-export-{dead.pid}-abc")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"grpo-export-{os.getpid()}-def", "grpo-export-xyz", "other"]
    )


def test_the_suites_caches_are_its_own_not_the_hosts():
    """The project's caches (XLA's figures of `grpo check`, models copied from URLs, the workers'
    compilation cache) are folders of this session's (tests/conftest.py), outside the host's
    cache: a report an earlier run left there can neither pass a check nor hide what a compile costs."""
    from grpo_core.stages.aot import cache_dir as aot_cache
    from grpo_core.store.sources import cache_dir as model_cache

    folders = {aot_cache(), model_cache(), os.environ["JAX_COMPILATION_CACHE_DIR"]}
    hosts = {
        os.path.realpath(h) + os.sep for h in (os.path.expanduser("~/.cache"), os.environ.get("XDG_CACHE_HOME")) if h
    }
    assert len(folders) == 3 and all(os.path.isdir(f) for f in folders), folders
    assert not [f for f in folders if os.path.realpath(f).startswith(tuple(hosts))], folders
