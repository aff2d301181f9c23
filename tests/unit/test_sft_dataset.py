"""The SFT dataset option: a preset, a local chat file or a Hub id; a missing file says so."""

import functools

import pytest

from flows import command
from tests.unit.conftest_data import instruction_rows, write_jsonl
from trainflow.data import prepare_dataset

parse_args = functools.partial(command.parse_args, "sft")


def test_missing_local_file_is_reported_as_missing(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--dataset", "/nonexistent/data.jsonl"])
    assert info.value.code == 2
    assert "dataset file '/nonexistent/data.jsonl' does not exist" in capsys.readouterr().err


def test_unknown_name_lists_what_a_dataset_can_be(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--dataset", "nope"])
    err = capsys.readouterr().err
    assert "'nope'" in err and "instructions" in err and "local file" in err


def test_local_chat_file_is_prepared_with_a_held_out_split(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path / "home"))
    path = tmp_path / "my_chats.jsonl"
    write_jsonl(instruction_rows(100, seed=3), path)
    config = parse_args(["--dataset", str(path), "--validation-fraction", "0.2"])
    data = prepare_dataset(config.data_config())
    assert data.uri.rsplit("/", 1)[-1].startswith("my_chats-")
    counts = {split: info.num_samples for split, info in data.splits.items()}
    assert counts == {"train": 80, "validation": 20}
    assert {"input_ids", "assistant_masks"} <= set(data.columns)
