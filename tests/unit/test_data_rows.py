"""Bad rows in a data file are named by line and column before any conversion starts."""

import json
import re

import pytest

from trainflow.data import DataConfig, DataError
from trainflow.data.checks import check_json_rows
from trainflow.data.sources import load_source

GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (f"{GOOD}\n{GOOD}\n\x00\xff\xfe garbage\n".encode("latin-1"), "line 3 is not UTF-8"),
        (f"{GOOD}\n{GOOD[:20]}\n{GOOD}\n".encode(), "line 2, column 16 is not valid JSON"),
        (f"{GOOD}\n[1, 2]\n".encode(), "line 2 is a JSON list, not an object of columns"),
        (b"\n   \n\n", "has no rows: every line is blank"),
        (b"[]", "has no rows (an empty JSON array)"),
        (f'[{GOOD},\n{{"messages": ]'.encode(), "line 2, column 14 is not valid JSON"),
    ],
    ids=["binary-line", "truncated-line", "not-an-object", "blank-file", "empty-array", "array"],
)
def test_a_bad_row_is_named_by_file_line_and_column(tmp_path, content, message):
    path = tmp_path / "chats.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=re.escape(message)) as err:
        check_json_rows(path, "train")
    assert str(path) in str(err.value) and "split 'train'" in str(err.value)


def test_good_rows_and_arrays_pass(tmp_path):
    lines, array = tmp_path / "a.jsonl", tmp_path / "b.json"
    lines.write_text(f"{GOOD}\n\n{GOOD}\n")
    array.write_text(f"[{GOOD}, {GOOD}]")
    check_json_rows(lines, "train")
    check_json_rows(array, "train")


def test_loading_a_source_reports_the_bad_line_before_datasets_parses_it(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text('{"x": 1}\n{"x": 2}\n{oops\n')
    config = DataConfig.model_validate(
        {
            "name": "chats",
            "source": {"kind": "files", "files": {"train": [str(path)]}},
            "transform": {"name": "tabular", "columns": {"x": "int64"}},
        }
    )
    with pytest.raises(DataError, match="line 3, column 2 is not valid JSON"):
        load_source(config)
