"""`load_tokenizer` parses a tokenizer once per process, hands out copies, and sees edits."""

import json
import shutil

import pytest
from transformers import AutoTokenizer

from tests.unit.conftest_data import TOKENIZER
from trainflow.data.tokenizer import load_tokenizer


@pytest.fixture
def parses(monkeypatch):
    """Count the tokenizer files parsed by `from_pretrained`."""
    calls: list[str] = []
    original = AutoTokenizer.from_pretrained

    def counting(name_or_path, *args, **kwargs):
        calls.append(name_or_path)
        return original(name_or_path, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", counting)
    return calls


def test_same_tokenizer_is_parsed_once_and_each_caller_gets_its_own_copy(tmp_path, parses):
    path = shutil.copytree(TOKENIZER, tmp_path / "tok")
    first = load_tokenizer(str(path))
    second = load_tokenizer(str(path), need_chat_template=True)
    assert len(parses) == 1
    assert first is not second
    assert first("hello world")["input_ids"] == second("hello world")["input_ids"]
    first.padding_side = "left"
    assert load_tokenizer(str(path)).padding_side == second.padding_side != "left"


def test_edited_tokenizer_is_read_again(tmp_path, parses):
    path = shutil.copytree(TOKENIZER, tmp_path / "tok")
    assert load_tokenizer(str(path)).model_max_length == 512
    config_file = path / "tokenizer_config.json"
    settings = json.loads(config_file.read_text())
    settings["model_max_length"] = 1024
    config_file.write_text(json.dumps(settings))
    assert load_tokenizer(str(path)).model_max_length == 1024
    assert len(parses) == 2
