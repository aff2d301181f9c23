"""Fast conversion and reads: parallel writers, one-render chat masks, batch collation.

Real files, real `streaming` and real writer processes; faults are injected into a writer
process by replacing `MDSWriter.write` before the writers fork, as a full disk or a kill would
strike them.
"""

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import pytest
import torch
from streaming import MDSWriter, StreamingDataset

from tests.unit.conftest_data import TOKENIZER, batch_ids, chat_config
from trainflow.data import DataError, LoaderConfig, PadCollate, build_dataloader, prepare_dataset
from trainflow.data.paths import stream_cache_dir
from trainflow.data.synthetic import instruction_rows
from trainflow.data.tokenizer import load_tokenizer
from trainflow.data.transforms import _ChatTokenizer, num_processes


def _samples(uri: str) -> list[dict]:
    dataset = StreamingDataset(local=str(Path(uri) / "train"), batch_size=1)
    return [dataset[i] for i in range(dataset.num_samples)]


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


# It opens `streaming` datasets in the test's own process: streaming picks their shared-memory
# prefix by probing names, which another worker's dataset opened at the same moment can take
# first (a FileExistsError seen once in a parallel run).
@pytest.mark.alone
def test_parallel_writers_write_the_single_writers_samples_in_its_order(tmp_path, monkeypatch):
    single = prepare_dataset(chat_config(tmp_path, num_rows=300, shard_size="4kb", num_proc=1))
    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path / "fresh-home"))  # no shared map cache
    parallel = prepare_dataset(
        chat_config(
            tmp_path,
            num_rows=300,
            shard_size="4kb",
            num_proc=2,
            output_root=str(tmp_path / "parallel"),
        )
    )
    assert parallel.fingerprint == single.fingerprint
    shards = json.loads((Path(parallel.uri) / "train" / "index.json").read_text())["shards"]
    parts = [s["zip_data"]["basename"].split("/")[0] for s in shards]
    assert parts == sorted(parts) and set(parts) == {"part-00000", "part-00001"}
    assert not (Path(single.uri) / "train" / "part-00000").exists()
    assert _same(_samples(single.uri), _samples(parallel.uri))
    assert parallel.splits["train"].num_samples == 300

    loader = build_dataloader(parallel.uri, "train", LoaderConfig(batch_size=32, shuffle=False))
    assert [i for batch in batch_ids(loader) for i in batch] == list(range(300))


def _fail_in_writer_processes(monkeypatch, fault):
    parent = os.getpid()
    original = MDSWriter.write
    written = []

    def write(self, sample):
        written.append(1)
        if os.getpid() != parent and len(written) == 20:
            fault()
        original(self, sample)

    monkeypatch.setattr(MDSWriter, "write", write)


def _disk_full():
    raise OSError("disk full (injected)")


def _killed():
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize(
    ("fault", "error"),
    [(_disk_full, OSError), (_killed, BrokenProcessPool)],
    ids=["raises", "dies"],
)
def test_a_failing_writer_process_leaves_nothing_published(tmp_path, monkeypatch, fault, error):
    config = chat_config(tmp_path, num_rows=200, num_proc=2)
    _fail_in_writer_processes(monkeypatch, fault)
    with pytest.raises(error):
        prepare_dataset(config)
    out = Path(config.output_root)
    assert list(out.iterdir()) == [], "no published dataset and no temp directory may remain"

    monkeypatch.undo()
    result = prepare_dataset(config)
    assert not result.cache_hit and result.splits["train"].num_samples == 200


def test_a_corrupted_shard_of_a_part_fails_the_read_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path / "home"))
    result = prepare_dataset(chat_config(tmp_path, num_rows=200, shard_size="4kb", num_proc=2))
    config = LoaderConfig(batch_size=16, shuffle=False)
    for _ in range(2):  # the cached copies are checked, and remembered as intact
        assert len([i for b in batch_ids(build_dataloader(result.uri, "train", config)) for i in b])

    copy = sorted((stream_cache_dir(result.uri) / "train" / "part-00001").glob("shard.*.mds"))[0]
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    # A damaged cached copy is fetched again from the published one, even after it was checked.
    ids = [i for b in batch_ids(build_dataloader(result.uri, "train", config)) for i in b]
    assert ids == list(range(200))

    published = sorted((Path(result.uri) / "train" / "part-00001").glob("shard.*"))[0]
    data = bytearray(published.read_bytes())
    data[len(data) // 2] ^= 0xFF
    published.write_bytes(bytes(data))
    copy.unlink()  # so the damaged published shard is fetched again
    copy.with_name(published.name).unlink(missing_ok=True)
    with pytest.raises(DataError, match=published.name):
        batch_ids(build_dataloader(result.uri, "train", config))


def test_marked_template_masks_equal_the_turn_prefix_masks():
    tokenizer = load_tokenizer(TOKENIZER, need_chat_template=True)
    unmarked = load_tokenizer(TOKENIZER, need_chat_template=True)
    unmarked.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""
    )
    rows = instruction_rows(200, seed=3)
    conversations = [r["messages"] for r in rows] + [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "add 1 2"},
            {"role": "assistant", "content": "3"},
            {"role": "user", "content": "upper ab"},
            {"role": "assistant", "content": "AB"},
        ]
    ]
    batch = {"id": list(range(len(conversations))), "messages": conversations}
    marked_fn = _ChatTokenizer(tokenizer, "messages", "train")
    prefix_fn = _ChatTokenizer(unmarked, "messages", "train")
    assert marked_fn.marked and not prefix_fn.marked
    marked, prefix = marked_fn(batch), prefix_fn(batch)
    assert marked["input_ids"] == prefix["input_ids"]
    assert marked["assistant_masks"] == prefix["assistant_masks"]
    assert sum(marked["assistant_masks"][-1]) > sum(marked["assistant_masks"][0])


def test_marked_templates_tokenize_in_parallel_threads():
    """A sweep's parallel trials tokenize in one process; transformers shares a template's
    compiled environment (and its generation tracker) between them."""
    rows = instruction_rows(300, seed=5)
    batch = {"id": [r["id"] for r in rows], "messages": [r["messages"] for r in rows]}
    expected = _ChatTokenizer(load_tokenizer(TOKENIZER, need_chat_template=True), "messages", "t")(
        batch
    )

    def tokenize(_: int) -> dict:
        fn = _ChatTokenizer(load_tokenizer(TOKENIZER, need_chat_template=True), "messages", "t")
        return [fn(batch) for _ in range(2)][-1]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(tokenize, range(4)))
    assert all(r == expected for r in results)


def test_marked_template_names_the_row_without_an_answer_or_with_a_bad_role():
    fn = _ChatTokenizer(load_tokenizer(TOKENIZER, need_chat_template=True), "messages", "train")
    good = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(DataError, match="row id 8 .* no assistant message"):
        fn({"id": [7, 8], "messages": [good, [{"role": "user", "content": "a"}]]})
    bad_role = [{"role": "robot", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(DataError, match="row id 9 .* chat template failed: .*unknown role robot"):
        fn({"id": [7, 9], "messages": [good, bad_role]})


def test_pad_collate_keeps_dtypes_and_pads_with_the_column_value():
    samples = [
        {"id": np.int64(i), "input_ids": np.arange(n, dtype=np.int32), "task": "add"}
        for i, n in enumerate([3, 1, 4])
    ]
    batch = PadCollate({"input_ids": 9})(samples)
    assert batch["input_ids"].dtype == torch.int32
    assert batch["input_ids"].tolist() == [[0, 1, 2, 9], [0, 9, 9, 9], [0, 1, 2, 3]]
    assert batch["id"].tolist() == [0, 1, 2] and batch["task"] == ["add"] * 3


def test_processes_follow_num_proc_else_the_cores_and_the_rows(tmp_path):
    config = chat_config(tmp_path, num_rows=10)
    assert num_processes(config.model_copy(update={"num_proc": 3}), 10) == 3
    assert num_processes(config.model_copy(update={"num_proc": 1}), 10**6) is None
    assert num_processes(config, 100) is None
    cores = len(os.sched_getaffinity(0))
    assert num_processes(config, 10**6) == (cores if cores > 1 else None)
