"""The pipeline end to end on the tiny preset, against a real Prefect server: a clean run, a run
whose worker is SIGKILLed twice (mid-epoch and right after an epoch's last checkpoint), a second
run of a finished config, and bad input that must fail at once without a stage marker."""

import base64
import json
import os
import re

import jax
import numpy as np
import pytest

from grpo_core.rl.checkpoint import Checkpointer
from grpo_core.store.root import RunRoot

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]

NUM_STEPS = 6


def small_config(root: str, name: str, **sections) -> dict:
    cfg = {
        "run_name": name,
        "storage": {"root": root},
        "data": {"eval_rows": 8, "synthetic_rows": 64},
        "train": {"num_steps": NUM_STEPS, "grpo": {"prompts_per_step": 4}, "optimizer": {"learning_rate": 1e-2}},
        "eval": {"num_samples": 2, "batch_size": 8},
        "pipeline": {"epochs": 2, "checkpoint_every": 2, "retries": 2, "retry_delay_s": 0, "flow_retries": 0},
    }
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return cfg


def run_pipeline(cfg: dict):
    from flows.pipeline import grpo_pipeline

    return grpo_pipeline.with_options(retries=0)(cfg)


def final_params(run_url: str, step: int = NUM_STEPS):
    with Checkpointer(RunRoot(run_url).uri("checkpoints")) as ckpt:
        state, meta = ckpt.restore(step)
    assert meta["step"] == step
    return state["params"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("runs"))
    summary = run_pipeline(small_config(root, "baseline", pipeline={"report_to": ["tensorboard"]}))
    return root, summary


def test_clean_run_writes_every_output(baseline):
    root, s = baseline
    run = RunRoot(f"{root}/baseline")
    assert s["status"] == "completed" and s["steps"] == NUM_STEPS
    assert set(s) >= {
        "status",
        "steps",
        "reward_mean_first",
        "reward_mean_last",
        "eval_before",
        "eval_after",
        "checkpoint_uri",
        "export_uri",
    }
    assert run.read_json("summary.json") == json.loads(json.dumps(s))
    assert s["checkpoint_uri"] == run.uri("checkpoints", str(NUM_STEPS))
    assert s["eval_before"]["step"] == 0 and s["eval_after"]["step"] == NUM_STEPS
    assert set(s["eval_after"]) >= {"accuracy", "pass@1", "pass@2", "reward_mean"}
    assert run.read_bytes("curve.png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert [m["step"] for m in run.read_metrics()] == list(range(NUM_STEPS))
    assert sorted(run.list("eval")) == ["0.json", "3.json", "6.json"]
    assert run.read_json("readiness.json")["ready"] is True
    cfg = run.read_json("config.json")
    assert run.is_done(f"data/{cfg['hashes']['data']}")
    assert run.is_done("stages/train-epoch-0") and run.is_done("stages/train-epoch-1")
    timing = s["timing"]
    assert 0 < timing["train_steps_s"] < timing["wall_s"]
    assert s["export_uri"] == run.uri("export", str(NUM_STEPS)) and run.is_done(f"export/{NUM_STEPS}")
    # Each epoch's training worker went on to evaluate it (the last one to export too): written
    # before the task marked the epoch done, when the worker had exited. No process of their own.
    written = lambda rel: os.path.getmtime(os.path.join(root, "baseline", rel))  # noqa: E731
    epoch0, epoch1 = (written(f"stages/train-epoch-{e}/{run.MARKER}") for e in (0, 1))
    assert written("eval/0.json") < written("eval/3.json") < epoch0 < written("eval/6.json") < epoch1
    assert written(f"export/{NUM_STEPS}/{run.MARKER}") < epoch1


def test_export_loads_in_transformers_with_the_trained_logits(baseline):
    """The demo's policy and character tokenizer as a Hugging Face folder: transformers loads both,
    encodes text to the same ids and computes the logits of the final checkpoint."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from flax import nnx

    from grpo_core.config.run import RunConfig
    from grpo_core.stages.parts import open_run

    root, _ = baseline
    run = RunRoot(f"{root}/baseline")
    export = f"{root}/baseline/export/{NUM_STEPS}"
    tok = transformers.AutoTokenizer.from_pretrained(export)
    parts = open_run(RunConfig.from_dict(run.read_json("config.json")), run)
    assert tok.encode("abc=", add_special_tokens=False) == parts.tokenizer.encode("abc=")
    with Checkpointer(run.uri("checkpoints")) as ckpt:
        ours = nnx.merge(*parts.policy_at(ckpt, NUM_STEPS))
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ids = np.asarray([parts.tokenizer.encode("abc=cba")])
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    got = np.asarray(ours(ids))
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4


def artifacts(key: str) -> list:
    """Every version of the artifact `key`, oldest first, from the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        newest_first = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), sort=ArtifactSort.CREATED_DESC
        )
    return newest_first[::-1]


def test_progress_is_the_whole_runs_and_the_curve_is_in_the_summary(baseline):
    root, _ = baseline
    run = RunRoot(f"{root}/baseline")
    # one progress artifact per flow run, the whole run's share, which each epoch (and each retry)
    # updates: before, one per epoch and attempt (15 after a flow retry); the card shows the
    # description, so it leads with the percentage (issue 30, item 4)
    progress = artifacts("train-baseline")
    assert len({a.flow_run_id for a in progress}) == len(progress)
    assert progress[0].data == 100.0 and progress[0].description.startswith("100% - training baseline")
    assert all("of 6" in a.description for a in progress)
    # the curve is embedded in the summary (a link to a local file opens nothing in the UI)
    # pipeline.report_to: TensorBoard's reader finds the run's metrics and evaluations in the run root
    from tests.test_tracking import scalars

    # both at the steps done: the reward of the 3rd step at 3, beside the evaluation of checkpoint 3 (issue 65)
    assert [step for step, _ in scalars(run.url, "reward")] == list(range(1, NUM_STEPS + 1))
    assert [step for step, _ in scalars(run.url, "eval/accuracy")] == [0, 3, 6]
    markdown = artifacts("summary-baseline")[-1].data
    b64 = re.search(r"!\[[^]]*\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown)
    assert b64 and base64.b64decode(b64.group(1)) == run.read_bytes("curve.png")


def test_second_run_of_a_finished_config_trains_nothing(baseline, monkeypatch):
    root, first = baseline
    run = RunRoot(f"{root}/baseline")
    shards = run.list("metrics")

    def no_worker(*args, **kwargs):
        raise AssertionError("a finished run started a worker process")

    # every stage is done: readiness and export start no process (seconds, not ~10 s each)
    monkeypatch.setattr("tasks.stages.run_worker", no_worker)
    monkeypatch.setattr("tasks.stages.readiness_report", no_worker)
    from grpo_core.resolve import resolve_run

    resolved = []  # the flow run's name and its body: one resolution of the config between them

    def counted(cfg, warn=None):
        resolved.append(cfg.run_name)
        return resolve_run(cfg, warn)

    monkeypatch.setattr("flows.pipeline.resolve_run", counted)
    s = run_pipeline(small_config(root, "baseline"))
    assert resolved == ["baseline"]
    assert s["status"] == "completed" and s["steps"] == NUM_STEPS
    assert run.list("metrics") == shards  # no step ran again
    assert s["eval_after"] == first["eval_after"]
    # the run's timing is the run that trained's, not the no-op's; the no-op's wall time is its own
    assert s["timing"] == first["timing"] and run.read_json("summary.json")["timing"] == first["timing"]
    assert s["last_invocation"]["did_work"] is False and 0 < s["last_invocation"]["wall_s"] < first["timing"]["wall_s"]


def test_nightly_run_starts_from_the_last_finished_run(baseline):
    """The nightly pattern: run_name nightly-{date} and init_from a pattern. The flow fills the
    name in once (stored for its retries), starts from the baseline's final export and says so;
    its step 0 is that policy, evaluated the same."""
    root, first = baseline
    cfg = small_config(
        root, "nightly-{date}", model={"init_from": "baseline*"}, train={"num_steps": 2}, pipeline={"epochs": 1}
    )
    s = run_pipeline(cfg)
    store = RunRoot(root)
    [record] = [store.read_json(f"_flow-runs/{n}") for n in store.list("_flow-runs")]
    assert record["template"] == "nightly-{date}" and re.fullmatch(r"nightly-\d{4}-\d\d-\d\d", record["run_name"])
    assert s["status"] == "completed" and s["run_uri"] == f"{root}/{record['run_name']}" and s["steps"] == 2
    want = {
        "run": f"{root}/baseline",
        "step": NUM_STEPS,
        "kind": "export",
        "uri": f"{root}/baseline/export/{NUM_STEPS}",
    }
    assert s["started_from"] == want
    assert s["eval_before"]["accuracy"] == first["eval_after"]["accuracy"]
    versions = RunRoot(s["run_uri"]).read_json("config.json")["versions"]
    assert versions["model.init_from"].startswith(f"{root}/baseline@{NUM_STEPS}:export:")


def test_a_retry_of_a_flow_run_reads_the_run_name_it_filled_in(tmp_path):
    from prefect import flow, get_run_logger

    from flows.pipeline import _fill_run_name
    from grpo_core.config.run import RunConfig

    names = []

    @flow(retries=1, retry_delay_seconds=0)
    def attempt():
        cfg = RunConfig.from_dict({"run_name": "n-{datetime}", "storage": {"root": str(tmp_path)}})
        names.append(_fill_run_name(cfg, get_run_logger()).run_name)
        if len(names) == 1:  # preempted after naming its folder; the record is what the retry reads
            store = RunRoot(str(tmp_path))
            [rel] = store.list("_flow-runs")
            store.write_json(f"_flow-runs/{rel}", dict(store.read_json(f"_flow-runs/{rel}"), run_name="n-recorded"))
            raise RuntimeError("preempted")
        return names[-1]

    assert attempt() == "n-recorded" and re.fullmatch(r"n-\d{4}-\d\d-\d\d-\d{6}", names[0])
    attempt.with_options(retries=0)()  # another flow run: its own record, its own time
    assert len(RunRoot(str(tmp_path)).list("_flow-runs")) == 2


def test_deleted_epoch_marker_is_rebuilt_at_the_epochs_end(baseline):
    root, first = baseline
    run = RunRoot(f"{root}/baseline")
    want = run.done_info("stages/train-epoch-0")
    run.fs.rm(run.uri("stages/train-epoch-0/_SUCCESS"))
    s = run_pipeline(small_config(root, "baseline"))
    got = run.done_info("stages/train-epoch-0")
    assert got["step"] == want["step"] == NUM_STEPS // 2  # not the newest checkpoint's step
    assert got["reward"] == want["reward"] is not None and got["rebuilt"] is True
    assert s["eval_after"] == first["eval_after"] and s["timing"] == first["timing"]


def test_killed_worker_resumes_to_the_same_parameters(baseline, tmp_path, monkeypatch):
    root, _ = baseline
    # Killed after step 5 (mid epoch 1, its last checkpoint at 4) and right after epoch 0's
    # final checkpoint (3), before the stage marker: the retry must train 0 steps there, and
    # epoch 1 must still train its 3. Then killed again while evaluating step 6 after training,
    # in the same worker: the epoch stays trained, and the evaluate task evaluates 6 alone.
    from tests.faults import HOOK

    monkeypatch.setenv("GRPO_TEST_HOOK", HOOK)
    monkeypatch.setenv("GRPO_FAULT", f"checkpoint:3:{tmp_path}/f1,step:5:{tmp_path}/f2,eval:6:{tmp_path}/f3")
    s = run_pipeline(small_config(str(tmp_path), "killed", pipeline={"report_to": ["tensorboard"]}))
    assert all(os.path.exists(tmp_path / f) for f in ("f1", "f2", "f3"))  # every fault fired
    run = RunRoot(str(tmp_path / "killed"))
    assert s["eval_after"]["step"] == NUM_STEPS and run.read_json("eval/6.json")["step"] == NUM_STEPS
    from tests.test_tracking import scalars

    assert [step for step, _ in scalars(run.url, "reward")] == list(range(1, NUM_STEPS + 1))  # re-run steps sent once
    assert s["status"] == "completed" and s["steps"] == NUM_STEPS
    assert [m["step"] for m in run.read_metrics()] == list(range(NUM_STEPS))
    assert run.done_info("stages/train-epoch-0")["steps_run"] == 0  # resumed at the boundary
    assert run.done_info("stages/train-epoch-1")["step"] == NUM_STEPS
    assert run.done_info("stages/train-epoch-1")["steps_run"] == 2  # 4 -> 6 once: the killed eval re-trained nothing
    want, got = final_params(f"{root}/baseline"), final_params(str(tmp_path / "killed"))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def task_runs(state) -> dict[str, int]:
    """Task name -> attempts, for the flow run behind `state`, from the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    # Default run names carry a 3-hex suffix (prepare-dataset-c07); named ones do not.
    return {re.sub(r"-[0-9a-f]{3}$", "", r.name): r.run_count for r in runs}


def failed_run(cfg: dict):
    from flows.pipeline import grpo_pipeline

    state = grpo_pipeline.with_options(retries=0)(cfg, return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception) as err:
        state.result()
    return state, str(err.value)


def test_bad_data_fails_at_once_without_a_marker(tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n' * 4)
    state, msg = failed_run(small_config(str(tmp_path), "bad", data={"source": str(data)}))
    assert f"{data} row 0 has no column 'prompt' (data.prompt_column)" in msg
    run = RunRoot(str(tmp_path / "bad"))
    assert not any(run.is_done(f"data/{h}") for h in run.list("data"))
    s = run.read_json("summary.json")
    assert s["status"] == "failed" and "has no column 'prompt'" in s["error"] and s["steps"] == 0
    assert task_runs(state)["prepare-dataset"] == 1  # a data error is not retried


def test_reward_error_fails_at_once_naming_the_row(tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def boom(prompts, completions, **kw):\n    return [1 / 0 for _ in completions]\n")
    state, msg = failed_run(small_config(str(tmp_path), "reward", rewards=[{"function": f"{bad}:boom"}]))
    assert "reward function error" in msg and "'boom' raised ZeroDivisionError" in msg and "on row 0" in msg
    runs = task_runs(state)
    assert runs["train-epoch-0"] == 1 and "evaluate-[0, 3]" not in runs
    run = RunRoot(str(tmp_path / "reward"))
    assert not run.is_done("stages/train-epoch-0") and run.read_json("summary.json")["status"] == "failed"


def test_unwritable_storage_root(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cfg = small_config(str(blocker), "r", pipeline={"retries": 0})
    state, msg = failed_run(cfg)
    assert f"cannot write {blocker}/r/config.json" in msg


def test_a_bucket_we_may_read_but_not_write_fails_at_init(gcs_faults):
    gcs_faults.read_only = True
    cfg = small_config(gcs_faults.url_for("runs"), "ro", pipeline={"retries": 0})
    state, msg = failed_run(cfg)
    assert "permission denied" in msg and "config.json" in msg
    assert set(task_runs(state)) <= {"init-run"}  # nothing after init was tried


def test_pipeline_on_gcs(gcs_emulator):
    """Two epochs on gs:// (fake-gcs-server): the summary, status and evaluations the Prefect
    process reads name every step the workers wrote after it first listed the run root."""
    from grpo_core.store.report import status

    url = gcs_emulator.url_for("runs")
    s = run_pipeline(small_config(url, "gs-run", pipeline={"epochs": 2}))
    run = RunRoot(f"{url}/gs-run")
    assert s["status"] == "completed" and s["steps"] == NUM_STEPS and s["run_uri"] == run.url
    assert s["checkpoint_uri"] == f"{url}/gs-run/checkpoints/{NUM_STEPS}"
    assert s["eval_after"]["step"] == NUM_STEPS and s["export_uri"] == f"{url}/gs-run/export/{NUM_STEPS}"
    assert run.read_json("summary.json")["steps"] == NUM_STEPS and run.read_bytes("curve.png")[:4] == b"\x89PNG"
    assert [m["step"] for m in run.read_metrics()] == list(range(NUM_STEPS))
    assert sorted(run.list("eval")) == ["0.json", "3.json", f"{NUM_STEPS}.json"]
    st = status(run)
    assert st["steps_done"] == NUM_STEPS and st["latest_checkpoint"] == NUM_STEPS
    assert [e["step"] for e in st["eval"]] == [0, 3, NUM_STEPS]
    assert st["stages_done"] == ["train-epoch-0", "train-epoch-1"]
    with Checkpointer(run.uri("checkpoints")) as ckpt:
        assert ckpt.latest_step() == NUM_STEPS
    # a run on gs:// as another run's start: Orbax's finalised steps, read without JAX, and a
    # continual run that starts from one of its checkpoints on the bucket
    from grpo_core.store.report import checkpoint_steps
    from grpo_core.store.startpoint import policies

    with Checkpointer(run.uri("checkpoints")) as ckpt:
        assert checkpoint_steps(run) == ckpt.all_steps() and policies(run)[NUM_STEPS] == "export"
    nxt = run_pipeline(
        small_config(
            url,
            "gs-next",
            model={"init_from": "gs-run@4"},
            train={"num_steps": 2},
            pipeline={"epochs": 1, "export": False},
        )
    )
    assert nxt["status"] == "completed" and nxt["started_from"]["uri"] == f"{url}/gs-run/checkpoints/4"
    assert nxt["started_from"]["kind"] == "checkpoint"
