"""A dataset prepared ahead by a launch's agent, as the prepare task takes it: the agent's real
outcome format (`trainflow.launch.agent.run_calls`) on a real published dataset."""

import io
import json

import pytest

from tests.unit.conftest_data import chat_config
from trainflow.data import DataError, ahead, dataset_fingerprint
from trainflow.launch.agent import run_calls


def _run_in_agent_format(tmp_path, config) -> dict:
    """Run the agent's prepare call as the agent does, and read its outcome line back."""
    function, argument = ahead.prepare_call(config)
    outcomes = io.StringIO()
    run_calls([{"function": function, "argument": argument}], outcomes)
    (line,) = outcomes.getvalue().splitlines()
    return json.loads(line)


def test_the_prepared_dataset_is_taken_once(tmp_path):
    config = chat_config(tmp_path)
    outcome = _run_in_agent_format(tmp_path, config)
    fingerprint = dataset_fingerprint(config)
    ahead.offer(config, lambda: outcome)
    taken = ahead.take(config, fingerprint)
    assert taken is not None and not taken.cache_hit and taken.fingerprint == fingerprint
    assert taken.splits["train"].num_samples == 200
    assert ahead.take(config, fingerprint) is None  # a retry builds it itself


def test_bad_data_found_ahead_is_a_data_error_naming_the_file(tmp_path):
    config = chat_config(tmp_path)
    bad = tmp_path / "chat.jsonl"
    bad.write_text('{"id": 1, "messages": "not a list"}\n')
    outcome = _run_in_agent_format(tmp_path, config)
    assert list(outcome) == ["refused"]
    ahead.offer(config, lambda: outcome)
    with pytest.raises(DataError, match="chat.jsonl"):
        ahead.take(config, dataset_fingerprint(config))


@pytest.mark.parametrize(
    "outcome",
    [None, {"failed": "Traceback ...\nOSError: disk full"}, {"value": "other"}],
    ids=["agent-gone", "failed", "other-dataset"],
)
def test_anything_but_this_dataset_leaves_the_build_to_the_caller(tmp_path, outcome):
    config = chat_config(tmp_path)
    if outcome == {"value": "other"}:
        (tmp_path / "other").mkdir()
        other = chat_config(tmp_path / "other", num_rows=50)
        outcome = _run_in_agent_format(tmp_path, other)
        assert "value" in outcome
    ahead.offer(config, lambda: outcome)
    assert ahead.take(config, dataset_fingerprint(config)) is None
    assert ahead.take(chat_config(tmp_path, num_rows=7), "x") is None  # nothing offered
