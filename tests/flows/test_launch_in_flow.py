"""A launch inside a real Prefect flow run: its own task run, rank lines in the run's logs."""

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.sorting import LogSort

from tests.conftest import flush_prefect_logs
from trainflow import RankError, distributed, runtime


@distributed(gpus=2, gpu_type="cpu", timeout=120)
def greet(word: str) -> int:
    print(f"{word} from rank {runtime.get_global_rank()}")
    return runtime.get_global_rank()


@flow(name="launch-in-flow")
def launching_flow() -> list[int]:
    return greet.distributed("hello")


@distributed(gpus=2, gpu_type="cpu", timeout=120)
def broken() -> None:
    if runtime.get_global_rank() == 1:
        raise KeyError("missing column")


@flow(name="launch-fails-in-flow")
def failing_flow() -> None:
    broken.distributed()


def _logs(flow_run_id) -> list[str]:
    flush_prefect_logs()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
            sort=LogSort.TIMESTAMP_ASC,
        )
    return [log.message for log in logs]


def test_launch_in_flow_is_a_task_run_with_rank_logs(prefect_api):
    state = launching_flow(return_state=True)
    assert state.is_completed()
    assert state.result() == [0, 1]
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        artifacts = client.read_artifacts()
    assert [t.name for t in task_runs] == ["greet.distributed[2]"]
    assert task_runs[0].state.is_completed()
    messages = _logs(flow_run_id)
    assert "[rank 1] hello from rank 1" in messages
    assert "[rank 0] hello from rank 0" in messages
    assert any(m.startswith("Full rank logs: ") for m in messages)
    assert any(a.key == "rank-logs" and "rank_1.log" in (a.data or "") for a in artifacts)


def test_failing_rank_fails_the_flow_run_with_the_rank_named(prefect_api):
    state = failing_flow(return_state=True)
    assert state.is_failed()
    with pytest.raises(RankError, match="rank 1 failed .* KeyError: 'missing column'"):
        state.result()
