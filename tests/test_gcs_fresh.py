"""gs:// as the Prefect process sees it: every listing, existence check and read reflects the
bucket when it is made, though other processes (the workers) wrote the objects after this
process first looked. gcsfs keeps the listings of its (process-wide, cached) filesystem
instances with no expiry; each test here failed while the readers went through them.

`other` is a second client, with its own gcsfs instance, as a worker process is."""

import json

import gcsfs
import pytest

from grpo_core.store.report import checkpoint_steps, eval_results, latest_checkpoint, status
from grpo_core.store.root import RunRoot, filesystem


@pytest.fixture
def other(gcs_emulator):
    return gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)


def _eval(step: int) -> dict:
    return {"step": step, "accuracy": step / 100, "pass@1": 0.0, "greedy": {"reward_mean": 0.5}}


def test_listings_and_markers_written_by_another_process_are_seen(gcs_emulator, other):
    root = RunRoot(gcs_emulator.url_for("runs") + "/r")
    root.write_json("eval/0.json", _eval(0))
    assert root.list("eval") == ["0.json"] and not root.is_done("stages/train-epoch-0")
    other.pipe_file(root.uri("eval/20.json"), json.dumps(_eval(20)).encode())
    other.pipe_file(root.uri("stages/train-epoch-0/_SUCCESS"), b"{}")
    assert root.list("eval") == ["0.json", "20.json"]
    assert RunRoot(root.url).list("eval") == ["0.json", "20.json"]  # a new RunRoot, the same process
    assert root.is_done("stages/train-epoch-0") and root.exists("eval/20.json")
    other.rm_file(root.uri("eval/20.json"))
    assert root.list("eval") == ["0.json"] and not root.exists("eval/20.json")


def test_status_of_a_live_run_shows_its_current_step(gcs_emulator, other):
    """What `grpo status` and the summary read, while the worker goes on writing."""
    root = RunRoot(gcs_emulator.url_for("runs") + "/live")
    root.write_json("config.json", {"train": {"num_steps": 40}})
    root.write_metrics([{"step": s, "reward": 0.1} for s in range(20)])
    root.write_bytes("checkpoints/20/commit_success.txt", b"ok")
    root.write_json("eval/0.json", _eval(0))
    root.write_json("eval/20.json", _eval(20))
    before = status(root)
    assert before["steps_done"] == 20 and before["latest_checkpoint"] == 20
    # the worker of the next epoch, in its own process
    rows = "".join(json.dumps({"step": s, "reward": 0.2}) + "\n" for s in range(20, 40)).encode()
    other.pipe_file(root.uri("metrics/00000020-00000039.jsonl"), rows)
    other.pipe_file(root.uri("checkpoints/40/commit_success.txt"), b"ok")
    other.pipe_file(root.uri("eval/40.json"), json.dumps(_eval(40)).encode())
    after = status(root)
    assert after["steps_done"] == 40 and after["latest_checkpoint"] == 40
    assert [e["step"] for e in after["eval"]] == [0, 20, 40]
    assert latest_checkpoint(root) == 40 and checkpoint_steps(root) == [20, 40]
    assert [e["step"] for e in eval_results(RunRoot(root.url))] == [0, 20, 40]


def test_a_data_file_rewritten_after_its_folder_was_listed_is_read_whole(gcs_emulator, other):
    from grpo_core.data.prepare import _read_file
    from grpo_core.store.versions import version_of

    folder = gcs_emulator.url_for("data")
    url = f"{folder}/prompts.jsonl"
    other.pipe_file(url, b'{"prompt": "a"}\n')
    v1, v1_folder = version_of(url), version_of(folder)  # lists the folder: a cached listing before
    assert [r["prompt"] for r in _read_file(url)] == ["a"]
    other.pipe_file(url, b'{"prompt": "a"}\n{"prompt": "bb"}\n{"prompt": "ccc"}\n')
    assert [r["prompt"] for r in _read_file(url)] == ["a", "bb", "ccc"]
    assert version_of(url) != v1 and version_of(folder) != v1_folder


def test_a_model_folder_changed_on_the_bucket_is_fetched_again(gcs_emulator, other, tmp_path, monkeypatch):
    from grpo_core.store.sources import resolve

    monkeypatch.setenv("GRPO_MODEL_CACHE", str(tmp_path / "cache"))
    url = gcs_emulator.url_for("models") + "/m"
    other.pipe_file(f"{url}/config.json", b'{"model_type": "qwen2", "v": 1}')
    other.pipe_file(f"{url}/tokenizer.json", b"{}")
    local = resolve(url, weights=False)
    assert json.loads(open(f"{local}/config.json").read())["v"] == 1
    other.pipe_file(f"{url}/config.json", b'{"model_type": "qwen2", "v": 2}')
    other.pipe_file(f"{url}/generation_config.json", b'{"eos_token_id": 1}')
    local = resolve(url, weights=False)
    assert json.loads(open(f"{local}/config.json").read())["v"] == 2
    assert json.loads(open(f"{local}/generation_config.json").read()) == {"eos_token_id": 1}


def test_a_start_point_finished_by_another_process_is_found(gcs_emulator, other):
    from grpo_core.store.startpoint import policies

    run = RunRoot(gcs_emulator.url_for("runs") + "/src")
    run.write_bytes("checkpoints/2/commit_success.txt", b"ok")
    assert policies(run) == {2: "checkpoint"}
    other.pipe_file(run.uri("checkpoints/4/commit_success.txt"), b"ok")
    other.pipe_file(run.uri("export/4/_SUCCESS"), b"{}")
    assert policies(RunRoot(run.url)) == {2: "checkpoint", 4: "export"}


def test_the_filesystem_keeps_no_listing(gcs_emulator):
    fs, path = filesystem(gcs_emulator.url_for("x"))
    assert fs.dircache.use_listings_cache is False
