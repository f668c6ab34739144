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
    cfg = small_config(str(tmp_path), "bad", data={"source": str(data)})
    # before: the whole flow ran twice (flow_retries: 1 has no condition)
    state = grpo_pipeline.with_options(retries=1, retry_delay_seconds=0)(cfg, return_state=True)
    assert state.is_failed()
    assert _flow_run_count(state) == 1


def test_a_retryable_error_is_still_retried_by_the_flow(tmp_path):
    from flows.pipeline import grpo_pipeline

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")  # storage.root under a file: a storage error, retryable
    cfg = small_config(str(blocker), "r", pipeline={"retries": 0})
    state = grpo_pipeline.with_options(retries=1, retry_delay_seconds=0)(cfg, return_state=True)
    assert state.is_failed()
    assert _flow_run_count(state) == 2


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
