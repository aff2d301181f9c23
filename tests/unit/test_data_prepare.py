"""prepare_dataset on real files with real `streaming`: content, caching, crashes, bad input."""

import csv
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from streaming import MDSWriter, StreamingDataset
from transformers import AutoTokenizer

from tests.unit.conftest_data import (
    TOKENIZER,
    chat_config,
    run_python,
    tabular_config,
)
from trainflow.data import DataError, load_preset, prepare_dataset
from trainflow.data.synthetic import write_jsonl


def _read_split(uri: str, split: str) -> list[dict]:
    """Every sample of a published local split, read directly with streaming."""
    dataset = StreamingDataset(local=str(Path(uri) / split), batch_size=1)
    return [dataset[i] for i in range(dataset.num_samples)]


def _published(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if not p.name.startswith("."))


def test_instructions_preset_becomes_chat_shards_with_answer_masks(tmp_path):
    config = load_preset("instructions").model_copy(update={"output_root": str(tmp_path)})
    result = prepare_dataset(config)
    lines = Path(config.source.files["train"][0]).read_text().splitlines()
    source = {json.loads(line)["id"]: json.loads(line) for line in lines}

    assert {s: i.num_samples for s, i in result.splits.items()} == {
        "train": 2700,
        "validation": 300,
    }
    assert result.columns == {
        "id": "int64",
        "input_ids": "ndarray:int32",
        "assistant_masks": "ndarray:uint8",
        "task": "str",
    }
    assert result.num_bytes == sum(s.num_bytes for s in result.splits.values()) > 0
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    validation = _read_split(result.uri, "validation")
    train_ids = {s["id"] for s in _read_split(result.uri, "train")}
    assert train_ids.isdisjoint(s["id"] for s in validation)
    assert train_ids | {s["id"] for s in validation} == set(source)
    for sample in validation:
        row = source[int(sample["id"])]
        prompt, answer = (m["content"] for m in row["messages"])
        ids, mask = sample["input_ids"], sample["assistant_masks"].astype(bool)
        assert tokenizer.decode(ids[mask]) == answer + tokenizer.eos_token
        assert tokenizer.decode(ids[~mask]) == f"{tokenizer.bos_token}<|user|>{prompt}<|assistant|>"
        assert sample["task"] == row["task"]


def test_interactions_preset_becomes_typed_columns_equal_to_the_csv(tmp_path):
    config = load_preset("interactions").model_copy(update={"output_root": str(tmp_path)})
    result = prepare_dataset(config)
    with open(config.source.files["train"][0]) as f:
        rows = {int(r["id"]): r for r in csv.DictReader(f)}

    counts = {"train": 16200, "validation": 1800, "test": 2000}
    assert {s: i.num_samples for s, i in result.splits.items()} == counts
    ids = {split: sorted(int(s["id"]) for s in _read_split(result.uri, split)) for split in counts}
    assert sorted(ids["train"] + ids["validation"] + ids["test"]) == sorted(rows)
    # A split by time: every held-out interaction happened after every training one.
    assert ids["train"][-1] < ids["validation"][0] and ids["validation"][-1] < ids["test"][0]
    samples = [s for split in counts for s in _read_split(result.uri, split)]
    for sample in samples:
        row = rows[int(sample["id"])]
        assert sample["user_id"] == int(row["user_id"]) and sample["item_id"] == int(row["item_id"])
        assert sample["clicked"].dtype == np.float32 and sample["clicked"] == float(row["clicked"])


def test_second_run_is_a_cache_hit_that_does_no_work(tmp_path, caplog, monkeypatch):
    config = tabular_config(tmp_path)
    first = prepare_dataset(config)
    files = {p: p.stat().st_mtime_ns for p in Path(first.uri).rglob("*")}

    def must_not_load(*_):
        raise AssertionError("a cache hit must not read the source")

    monkeypatch.setattr("trainflow.data.sources.load_source", must_not_load)
    with caplog.at_level(logging.INFO, logger="trainflow.data"):
        second = prepare_dataset(config)
    assert not first.cache_hit and second.cache_hit
    assert second.model_copy(update={"cache_hit": False}) == first
    assert {p: p.stat().st_mtime_ns for p in Path(first.uri).rglob("*")} == files
    assert f"cache hit: {first.uri} is already published" in caplog.text


def test_output_directory_is_addressed_by_content_not_by_path(tmp_path):
    config = tabular_config(tmp_path)
    uri = prepare_dataset(config).uri
    moved = tmp_path / "elsewhere" / "clicks.csv"
    moved.parent.mkdir()
    shutil.copy(config.source.files["train"][0], moved)
    source = config.source.model_copy(update={"files": {"train": [str(moved)]}})
    same = config.model_copy(update={"source": source})
    assert prepare_dataset(same).uri == uri

    moved.write_text(moved.read_text().replace(",1\n", ",0\n", 1))
    assert prepare_dataset(same).uri != uri
    other_options = config.model_copy(update={"shard_size": "64kb"})
    assert prepare_dataset(other_options).uri != uri
    assert Path(uri).name.startswith("clicks-")


def test_parallel_map_writes_the_same_samples(tmp_path, monkeypatch):
    serial = prepare_dataset(chat_config(tmp_path))
    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path / "fresh-home"))  # no shared map cache
    parallel_config = chat_config(tmp_path, num_proc=2, output_root=str(tmp_path / "parallel"))
    parallel = prepare_dataset(parallel_config)
    assert parallel.fingerprint == serial.fingerprint
    a, b = _read_split(serial.uri, "train"), _read_split(parallel.uri, "train")
    assert [s["id"] for s in a] == [s["id"] for s in b]
    assert all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b, strict=True))


def test_text_transform_appends_eos_and_truncates(tmp_path):
    path = tmp_path / "text.jsonl"
    write_jsonl([{"text": "add 1 2 " * n} for n in range(1, 6)], path)
    config = chat_config(
        tmp_path,
        source={"kind": "files", "files": {"train": [str(path)]}},
        id_column=None,
        transform={"name": "text", "tokenizer": TOKENIZER, "max_length": 8},
    )
    result = prepare_dataset(config)
    samples = _read_split(result.uri, "train")
    eos = AutoTokenizer.from_pretrained(TOKENIZER).eos_token_id
    assert [s["id"] for s in samples] == [0, 1, 2, 3, 4]
    assert samples[0]["input_ids"][-1] == eos
    assert max(len(s["input_ids"]) for s in samples) == 8
    assert result.splits["train"].num_dropped == 0


def test_chat_rows_over_max_length_are_dropped_and_counted(tmp_path):
    whole = prepare_dataset(chat_config(tmp_path, num_rows=100))
    lengths = [len(s["input_ids"]) for s in _read_split(whole.uri, "train")]
    limited = chat_config(tmp_path, num_rows=100)
    transform = limited.transform.model_copy(update={"max_length": 12})
    result = prepare_dataset(limited.model_copy(update={"transform": transform}))
    assert result.splits["train"].num_dropped == sum(n > 12 for n in lengths) > 0
    assert result.splits["train"].num_samples == sum(n <= 12 for n in lengths)


def test_crash_injected_mid_write_publishes_nothing_and_cleans_up(tmp_path, monkeypatch):
    config = tabular_config(tmp_path)
    original = MDSWriter.write
    calls = []

    def failing_write(self, sample):
        calls.append(1)
        if len(calls) == 50:
            raise OSError("disk full (injected)")
        original(self, sample)

    monkeypatch.setattr(MDSWriter, "write", failing_write)
    with pytest.raises(OSError, match="injected"):
        prepare_dataset(config)
    out = Path(config.output_root)
    assert list(out.iterdir()) == [], "no published dataset and no temp directory may remain"

    monkeypatch.setattr(MDSWriter, "write", original)
    result = prepare_dataset(config)
    assert not result.cache_hit and _published(out) == [Path(result.uri).name]


@pytest.mark.slow
def test_killed_mid_write_leaves_nothing_published_and_next_run_recovers(tmp_path):
    config = tabular_config(tmp_path)
    code = (
        "from tests.unit.conftest_data import prepare_and_die_mid_write as f; "
        f"f({config.model_dump_json()!r}, 50)"
    )
    proc = run_python(code)
    assert proc.wait(timeout=120) == -9
    out = Path(config.output_root)
    assert _published(out) == []
    leftovers = [p for p in out.iterdir() if ".tmp-" in p.name]
    assert len(leftovers) == 1 and (leftovers[0] / "train").is_dir()

    result = prepare_dataset(config)
    assert not result.cache_hit
    assert sorted(p.name for p in out.iterdir()) == [Path(result.uri).name]
    assert result.splits["train"].num_samples == 200


def test_missing_column_names_column_split_and_file(tmp_path):
    config = tabular_config(
        tmp_path, transform={"name": "tabular", "columns": {"user_id": "int64", "price": "float32"}}
    )
    with pytest.raises(
        DataError, match=r"file .*clicks\.csv of split 'train' has no column 'price'.*it has \["
    ):
        prepare_dataset(config)
    chat = chat_config(
        tmp_path,
        transform={"name": "chat", "tokenizer": TOKENIZER, "messages_column": "conversation"},
    )
    with pytest.raises(
        DataError,
        match=r"chat\.jsonl of split 'train': line 1 has no column 'conversation'.*it has \[",
    ):
        prepare_dataset(chat)


def test_wrong_type_names_column_and_split(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("id,user_id,item_id,clicked\n0,1,2,1\n1,alice,3,0\n")
    config = tabular_config(tmp_path, source={"kind": "files", "files": {"train": [str(path)]}})
    with pytest.raises(
        DataError,
        match=r"bad\.csv of split 'train': line 3, column 'user_id' holds 'alice'; "
        r"expected an integer \(int64\)",
    ):
        prepare_dataset(config)

    chat_path = tmp_path / "flat.jsonl"
    write_jsonl([{"id": 0, "messages": "just a string", "task": "x"}], chat_path)
    chat = chat_config(tmp_path, source={"kind": "files", "files": {"train": [str(chat_path)]}})
    with pytest.raises(DataError, match=r"column 'messages' of split 'train' .* not a list of"):
        prepare_dataset(chat)


def test_empty_file_and_empty_split_are_named(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    config = chat_config(tmp_path, source={"kind": "files", "files": {"train": [str(empty)]}})
    with pytest.raises(DataError, match=r"file .*empty\.jsonl of split 'train' is empty"):
        prepare_dataset(config)

    header_only = tmp_path / "header.csv"
    header_only.write_text("id,user_id,item_id,clicked\n")
    config = tabular_config(
        tmp_path, source={"kind": "files", "files": {"train": [str(header_only)]}}
    )
    with pytest.raises(DataError, match=r"header\.csv"):
        prepare_dataset(config)

    one_row = tmp_path / "one.jsonl"
    write_jsonl(
        [
            {
                "id": 0,
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                ],
                "task": "t",
            }
        ],
        one_row,
    )
    config = chat_config(
        tmp_path,
        source={"kind": "files", "files": {"train": [str(one_row)]}},
        transform={"name": "chat", "tokenizer": TOKENIZER, "max_length": 3},
    )
    with pytest.raises(DataError, match=r"split 'train' .* is empty after the 'chat' transform"):
        prepare_dataset(config)


def test_duplicate_ids_are_named(tmp_path):
    path = tmp_path / "dupes.csv"
    path.write_text("id,user_id,item_id,clicked\n7,1,2,1\n7,2,3,0\n")
    config = tabular_config(tmp_path, source={"kind": "files", "files": {"train": [str(path)]}})
    with pytest.raises(DataError, match=r"column 'id' \(id_column\) of split 'train' .* duplicate"):
        prepare_dataset(config)


def test_tokenizer_without_chat_template_is_named(tmp_path):
    plain = tmp_path / "plain-tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = chat_config(tmp_path, transform={"name": "chat", "tokenizer": str(plain)})
    with pytest.raises(DataError, match=rf"tokenizer '{plain}' has no chat template"):
        prepare_dataset(config)


def test_unwritable_output_root_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = tabular_config(tmp_path, output_root=str(blocker / "datasets"))
    with pytest.raises(DataError, match=rf"output_root {blocker / 'datasets'} is not writable"):
        prepare_dataset(config)


def test_hub_source_without_network_names_the_dataset(tmp_path, monkeypatch):
    """The hub path needs network; here (none) it must fail clearly, not hang or half-work."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tabular_config(tmp_path, source={"kind": "hub", "name": "someone/clicks"})
    with pytest.raises(
        DataError, match=r"hub dataset 'someone/clicks' \(revision main\) could not be resolved"
    ):
        prepare_dataset(config)
