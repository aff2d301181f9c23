"""The prepare flow on a real Prefect server: builds once, then is a logged cache hit."""

import shutil
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)

from flows.prepare import _config_from_args, prepare
from tests.conftest import flush_prefect_logs
from tests.unit.conftest_data import TOKENIZER, chat_config, tabular_config
from trainflow.data import DataError


def _task_states_and_logs(state) -> tuple[list[str], str]:
    flow_run_id = state.state_details.flow_run_id
    flush_prefect_logs()
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        )
    return [t.state.name for t in task_runs], "\n".join(log.message for log in logs)


def test_second_run_is_a_prefect_cache_hit_and_a_deleted_dataset_is_rebuilt(prefect_api, tmp_path):
    config = tabular_config(tmp_path)

    first = prepare(config, return_state=True)
    built = first.result()
    states, logs = _task_states_and_logs(first)
    assert states == ["Completed"] and not built.cache_hit
    assert f"built {built.uri}" in logs
    assert built.splits["train"].num_samples == 200

    second = prepare(config, return_state=True)
    cached = second.result()
    states, logs = _task_states_and_logs(second)
    assert states == ["Cached"]
    assert cached.cache_hit and cached.uri == built.uri
    assert f"cache hit: reusing {built.uri} from the Prefect cache" in logs

    # A cache record must never point at a dataset that is gone.
    shutil.rmtree(built.uri)
    third = prepare(config, return_state=True)
    rebuilt = third.result()
    states, _ = _task_states_and_logs(third)
    assert states == ["Completed"] and not rebuilt.cache_hit
    assert (Path(rebuilt.uri) / "manifest.json").is_file()


def test_a_dropping_transform_prints_no_bytecode_into_the_run_log(prefect_api, tmp_path):
    """`overflow: drop` filters with a lambda; dill disassembles it to hash it, and under the
    flow's print-to-log that disassembly used to land in the task's log."""
    config = chat_config(
        tmp_path,
        transform={"name": "chat", "tokenizer": TOKENIZER, "max_length": 12, "overflow": "drop"},
    )
    state = prepare(config, return_state=True)
    built = state.result()
    _, logs = _task_states_and_logs(state)
    assert built.splits["train"].num_dropped > 0  # the filter ran
    assert f"built {built.uri}" in logs
    assert "RETURN_VALUE" not in logs and "LOAD_FAST" not in logs


def test_command_line_selects_a_preset_or_a_yaml_config(tmp_path):
    assert _config_from_args([]).name == "instructions"
    assert _config_from_args(["--preset", "interactions"]).transform.name == "tabular"
    path = tmp_path / "data.yaml"
    config = tabular_config(tmp_path)
    path.write_text(config.model_dump_json())  # JSON is YAML
    assert _config_from_args(["--config", str(path)]) == config


def test_bad_input_fails_the_flow_once_naming_the_column(prefect_api, tmp_path):
    config = tabular_config(
        tmp_path, transform={"name": "tabular", "columns": {"price": "float32"}}
    )
    state = prepare(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(DataError, match="split 'train' has no column 'price'"):
        state.result()
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        (task_run,) = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    assert task_run.run_count == 1, "bad input must not be retried"
