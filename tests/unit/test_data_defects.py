"""Data defects, each through real files and real MDS shards:

- every pipeline that reads a published dataset checks its shards' hashes, the detection
  pipeline's in-place reader too, and a damaged shard is named at its published path;
- a damaged published dataset (a shard that fails its hash, a truncated shard, a manifest
  missing or unreadable) is rebuilt in place by the next prepare, never handed out again;
- more conversion processes than cores are refused before anything starts;
- a dataset file with a name in any script is accepted;
- bad two-tower rows are refused naming the file, line, column and what was expected.
"""

import gc
import json
import os
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.unit.conftest_data import chat_config, tabular_config
from trainflow.configs.two_tower import TwoTowerConfig
from trainflow.data import DataConfig, DataError, prepare_dataset
from trainflow.data.checks import check_files
from trainflow.data.config import name_for_file
from trainflow.data.paths import stream_cache_dir
from trainflow.data.shapes import ShapesSpec, write_shapes
from trainflow.workloads import detection, sft, two_tower
from trainflow.workloads.two_tower_checks import check_config

CORES = len(os.sched_getaffinity(0))  # what this process may use


def _flip(path: Path) -> None:
    """Flip one byte in the middle of `path` (its size stays the same)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _shard(uri: str, split: str) -> Path:
    return sorted((Path(uri) / split).glob("shard.*"))[0]


def _detection_config(tmp_path: Path) -> DataConfig:
    spec = ShapesSpec(num_classes=3, image_size=32, min_object_size=8, max_object_size=14)
    paths = write_shapes(tmp_path / "src", spec, {"train": 12, "validation": 4})
    return DataConfig(
        name="shapes",
        source={"kind": "files", "files": {s: [str(p)] for s, p in paths.items()}},
        transform={"name": "detection", "num_classes": 3},
        compression=None,
        shard_size="1mb",
        output_root=str(tmp_path / "out"),
    )


# Each pipeline's reader of a published split, and a dataset of the kind it reads. (The mlp
# and transformer pipelines draw their samples in memory: they read no published dataset.)
READERS = {
    "sft": (sft.read_split, chat_config),
    "two_tower": (two_tower.read_split, tabular_config),
    "detection": (detection.read_split, _detection_config),
}


def _read(reader, uri: str) -> int:
    rows = reader(uri, "train")
    gc.collect()  # streaming allows one open dataset per cache folder
    return len(rows) if isinstance(rows, list) else len(next(iter(rows.values())))


@pytest.mark.parametrize("pipeline", sorted(READERS))
def test_every_pipeline_reader_refuses_a_damaged_published_shard_naming_it(pipeline, tmp_path):
    reader, make_config = READERS[pipeline]
    result = prepare_dataset(make_config(tmp_path))
    shard = _shard(result.uri, "train")
    _flip(shard)
    with pytest.raises(DataError, match=re.escape(str(shard))) as info:
        reader(result.uri, "train")
    assert str(stream_cache_dir(result.uri)) not in str(info.value)  # not the cached copy


def test_a_shard_damaged_after_a_first_read_is_found_by_the_next_read(tmp_path):
    """Detection reads its shards in place on every read: each read checks them again."""
    result = prepare_dataset(_detection_config(tmp_path))
    assert len(detection.read_split(result.uri, "validation")) == 4
    shard = _shard(result.uri, "validation")
    _flip(shard)
    with pytest.raises(DataError, match=re.escape(str(shard))):
        detection.read_split(result.uri, "validation")


def test_a_published_shard_that_fails_its_hash_is_rebuilt_by_the_next_prepare(tmp_path):
    from trainflow.data.store import DAMAGED

    config = chat_config(tmp_path, num_rows=96)
    first = prepare_dataset(config)
    expected = sft.read_split(first.uri, "train")
    gc.collect()
    _flip(_shard(first.uri, "train"))

    shutil.rmtree(stream_cache_dir(first.uri))  # as a run on another node would read it
    with pytest.raises(DataError, match="next prepare"):
        sft.read_split(first.uri, "train")
    gc.collect()
    assert (Path(first.uri) / DAMAGED).is_file()

    again = prepare_dataset(config)
    assert not again.cache_hit and again.uri == first.uri
    assert not (Path(first.uri) / DAMAGED).exists()
    assert sft.read_split(again.uri, "train") == expected
    gc.collect()
    assert prepare_dataset(config).cache_hit


@pytest.mark.parametrize(
    "damage",
    ["truncated shard", "missing shard", "missing index", "missing manifest", "garbled manifest"],
)
def test_a_damaged_published_dataset_is_rebuilt_in_place(damage, tmp_path):
    config = tabular_config(tmp_path)
    first = prepare_dataset(config)
    root = Path(first.uri)
    shard = _shard(first.uri, "train")
    if damage == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "missing shard":
        shard.unlink()
    elif damage == "missing index":
        (root / "train" / "index.json").unlink()
    elif damage == "missing manifest":
        (root / "manifest.json").unlink()
    else:
        (root / "manifest.json").write_text('{"splits": {"train": ')

    again = prepare_dataset(config)
    assert not again.cache_hit and again.uri == first.uri
    assert json.loads((root / "manifest.json").read_text())["fingerprint"] == first.fingerprint
    assert _read(two_tower.read_split, again.uri) == first.splits["train"].num_samples
    # Nothing is left beside it: no staging folder, no damaged copy set aside.
    assert os.listdir(root.parent) == [root.name]


def test_more_processes_than_cores_are_refused_before_anything_is_written(tmp_path):
    figure = CORES + 1
    config = tabular_config(tmp_path, num_proc=figure)
    message = f"num_proc={figure} .* the limit is {CORES}"
    with pytest.raises(DataError, match=message):
        check_files(config)
    with pytest.raises(DataError, match=message):
        prepare_dataset(config)
    assert not (tmp_path / "out").exists()
    assert prepare_dataset(tabular_config(tmp_path, num_proc=CORES)).splits


@pytest.mark.parametrize(
    ("file_name", "name"),
    [
        ("données-训练.jsonl", "données-训练"),
        ("Обучение данные.jsonl", "Обучение-данные"),
        ("my data (v2).jsonl", "my-data-v2"),
        (".hidden.jsonl", "hidden"),
    ],
)
def test_a_dataset_file_of_any_valid_name_is_prepared(file_name, name, tmp_path):
    source = tmp_path / "chat.jsonl"
    chat_config(tmp_path, num_rows=40)  # writes chat.jsonl
    path = tmp_path / "x" / file_name
    path.parent.mkdir()
    source.rename(path)
    assert name_for_file(path) == name
    config = chat_config(
        tmp_path,
        name=name_for_file(path),
        source={"kind": "files", "files": {"train": [str(path)]}},
    )
    result = prepare_dataset(config)
    assert Path(result.uri).name.startswith(f"{name}-")
    assert _read(sft.read_split, result.uri) == 40


def test_a_dataset_name_that_is_no_folder_name_is_refused_naming_the_field(tmp_path):
    for bad in ("../up", "a/b", ".hidden", "a b", "é" * 65):
        with pytest.raises(ValueError, match="name"):
            chat_config(tmp_path, num_rows=4, name=bad)


# Two-tower interactions with one bad row (the 5th data row, line 6 of a CSV with its header).
GOOD = {"id": 4, "user_id": 3, "item_id": 2, "item_category": 1, "clicked": 0}
BAD_CSV_ROWS = {
    "text id": ("4,abc,2,1,0", "line 6, column 'user_id' holds 'abc'; expected an integer"),
    "empty id": ("4,,2,1,0", "line 6, column 'user_id' holds an empty value; expected an integer"),
    "fraction id": ("4,3,2.5,1,0", "line 6, column 'item_id' holds 2.5; expected an integer"),
    "text label": ("4,3,2,1,yes", "line 6, column 'clicked' holds 'yes'; expected a finite number"),
    "extra field": ("4,3,2,1,0,9", "line 6 has 6 field(s); the header has 5"),
    "short row": ("4,3,2", "line 6 has 3 field(s); the header has 5"),
}


def _rows(count: int = 40) -> list[dict]:
    return [
        {"id": i, "user_id": i % 7, "item_id": i % 5, "item_category": i % 3, "clicked": i % 2}
        for i in range(count)
    ]


def _two_tower(path: Path) -> TwoTowerConfig:
    return TwoTowerConfig.model_validate(
        {
            "data": {"dataset": str(path), "validation_fraction": 0.2, "test_fraction": 0.2},
            "towers": {"num_users": 10, "num_items": 10, "num_categories": 4},
            "training": {"batch_size": 4},
        }
    )


@pytest.mark.parametrize("case", sorted(BAD_CSV_ROWS))
def test_a_bad_two_tower_csv_row_is_named_by_file_line_and_column(case, tmp_path):
    row, message = BAD_CSV_ROWS[case]
    lines = ["id,user_id,item_id,item_category,clicked"]
    lines += [",".join(str(v) for v in r.values()) for r in _rows()]
    lines[5] = row
    path = tmp_path / "clicks.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as info:
        check_config(_two_tower(path))
    assert f"file {path} of split 'train': {message}" in str(info.value)


@pytest.mark.parametrize(
    ("value", "shown"),
    [('"x"', "'x'"), ("null", "an empty value"), ("true", "True"), ("1.5", "1.5")],
)
def test_a_bad_two_tower_json_row_is_named_by_file_line_and_column(value, shown, tmp_path):
    lines = [json.dumps(r) for r in _rows()]
    lines[4] = lines[4].replace('"user_id": 4', f'"user_id": {value}')
    path = tmp_path / "clicks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as info:
        check_config(_two_tower(path))
    assert f"data.user_column='user_id': file {path} of split 'train': line 5" in str(info.value)
    assert f"column 'user_id' holds {shown}; expected an integer (int64)" in str(info.value)


def test_a_bad_two_tower_parquet_column_is_named_with_what_was_expected(tmp_path):
    rows = _rows()
    table = pa.table({k: [r[k] for r in rows] for k in GOOD})
    path = tmp_path / "clicks.parquet"
    pq.write_table(
        table.set_column(1, "user_id", pa.array([str(r["user_id"]) for r in rows])), path
    )
    with pytest.raises(ValueError, match=r"column 'user_id' holds string values; expected an"):
        check_config(_two_tower(path))
    users = pa.array([None if i == 6 else r["user_id"] for i, r in enumerate(rows)], pa.int64())
    pq.write_table(table.set_column(1, "user_id", users), path)
    with pytest.raises(ValueError, match=r"row 7, column 'user_id' holds an empty value"):
        check_config(_two_tower(path))


def test_good_two_tower_rows_pass_the_checks(tmp_path):
    lines = ["id,user_id,item_id,item_category,clicked"]
    lines += [",".join(str(v) for v in r.values()) for r in _rows()]
    path = tmp_path / "clicks.csv"
    path.write_text("\n".join(lines) + "\n")
    check_config(_two_tower(path))
