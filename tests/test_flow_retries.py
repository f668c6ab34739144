"""The flow is retried only when a retry can succeed: Prefect's server retries a failed flow run
while it has retries left, with no condition, so the pipeline ends its own run's retries when the
error would repeat (config, data, reward, a stage's non-retryable exit)."""

import pytest

from tests.test_pipeline import small_config

pytestmark = pytest.mark.usefixtures("prefect_server")


def _flow_run_count(state) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(state.state_details.flow_run_id).run_count


def test_a_data_error_runs_the_flow_once_with_flow_retries(tmp_path):
    from flows.pipeline import grpo_pipeline

    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n' * 4)
    cfg = small_config(str(tmp_path), "bad", data={"source": str(data)}, pipeline={"flow_retries": 1})
    # before: the whole flow ran twice (flow_retries: 1 has no condition)
    state = grpo_pipeline.with_options(retries=1, retry_delay_seconds=0)(cfg, return_state=True)
    assert state.is_failed()
    assert _flow_run_count(state) == 1


def test_a_retryable_error_is_still_retried_by_the_flow(monkeypatch):
    import socket

    from flows.pipeline import grpo_pipeline

    with socket.socket() as s:  # a gs:// endpoint nothing listens on: connection refused, retryable
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"127.0.0.1:{s.getsockname()[1]}")
    cfg = small_config("gs://grpo-unreachable/runs", "r", pipeline={"retries": 0, "flow_retries": 2})
    state = grpo_pipeline.with_options(retries=0, retry_delay_seconds=0)(cfg, return_state=True)
    assert state.is_failed()
    assert _flow_run_count(state) == 3  # 1 + pipeline.flow_retries: the config's, not the decorator's


def test_a_storage_error_that_cannot_fix_itself_runs_once(tmp_path):
    """issue 30: a root under a file took 3 task x 2 flow attempts, each failing the same way."""
    from flows.pipeline import grpo_pipeline

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cfg = small_config(str(blocker), "r", pipeline={"retries": 2, "flow_retries": 1})
    state = grpo_pipeline.with_options(retries=1, retry_delay_seconds=0)(cfg, return_state=True)
    assert state.is_failed() and "a path in it is a file, not a folder" in state.message
    assert _flow_run_count(state) == 1


def test_a_flow_run_is_named_after_its_run(tmp_path):
    """The UI's list of flow runs says which run each one is (it showed random pairs of words)."""
    from prefect.client.orchestration import get_client

    from flows.pipeline import grpo_pipeline

    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n' * 4)
    state = grpo_pipeline.with_options(retries=0)(
        small_config(str(tmp_path), "gsm8k-lr3e-6", data={"source": str(data)}), return_state=True
    )
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(state.state_details.flow_run_id).name == "gsm8k-lr3e-6"
