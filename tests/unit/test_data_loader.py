"""build_dataloader in one process: order, resume guards, stale shared memory, bad shards, S3."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.conftest_data import REPO_ROOT, batch_ids, run_python, tabular_config
from trainflow.data import DataError, LoaderConfig, build_dataloader, prepare_dataset
from trainflow.data.paths import stream_cache_dir
from trainflow.data.shm import GRACE_S, SHM_DIR


@pytest.fixture
def clicks(tmp_path):
    """A published 200-row tabular dataset (train only)."""
    return prepare_dataset(tabular_config(tmp_path, shard_size="2kb"))


def _flat(batches):
    return [i for batch in batches for i in batch]


def test_one_rank_reads_every_sample_once_in_a_seeded_order(clicks):
    config = LoaderConfig(batch_size=8, seed=5)
    first = _flat(batch_ids(build_dataloader(clicks.uri, "train", config)))
    again = _flat(batch_ids(build_dataloader(clicks.uri, "train", config)))
    other = _flat(
        batch_ids(build_dataloader(clicks.uri, "train", config.model_copy(update={"seed": 6})))
    )
    assert sorted(first) == list(range(200))
    assert first == again
    assert first != other and sorted(other) == sorted(first)
    assert first != sorted(first)


def test_resume_in_one_process_continues_after_sample_k(clicks):
    config = LoaderConfig(batch_size=8, seed=1)
    order = _flat(batch_ids(build_dataloader(clicks.uri, "train", config)))
    head_loader = build_dataloader(clicks.uri, "train", config)
    head = _flat(batch_ids(head_loader, 7))
    state = head_loader.state_dict()
    assert state["sample_in_epoch"] == 56 and head == order[:56]
    tail = _flat(batch_ids(build_dataloader(clicks.uri, "train", config, state=state)))
    assert tail == order[56:]


def test_stale_state_that_streaming_would_ignore_is_refused(clicks):
    config = LoaderConfig(batch_size=50)
    loader = build_dataloader(clicks.uri, "train", config)
    batch_ids(loader, 1)
    state = loader.state_dict()
    batch_ids(loader)  # the loader has now begun epoch 1
    with pytest.raises(DataError, match="state is for epoch 0 but this loader already started"):
        loader.load_state_dict(state)
    with pytest.raises(DataError, match=r"missing \['num_canonical_nodes'"):
        loader.load_state_dict({"epoch": 0, "sample_in_epoch": 0, "shuffle_seed": 1})


def test_unknown_split_and_unpublished_uri_are_named(clicks, tmp_path):
    with pytest.raises(DataError, match=r"split 'test' not in dataset .*; it has \['train'\]"):
        build_dataloader(clicks.uri, "test", LoaderConfig(batch_size=4))
    with pytest.raises(DataError, match=rf"no published dataset at {tmp_path}"):
        build_dataloader(str(tmp_path), "train", LoaderConfig(batch_size=4))


def test_several_ranks_without_a_process_group_are_refused(clicks, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DataError, match="reading on 2 ranks needs the default process group"):
        build_dataloader(clicks.uri, "train", LoaderConfig(batch_size=4))


def test_corrupted_shard_fails_the_hash_check_naming_the_file(tmp_path):
    result = prepare_dataset(tabular_config(tmp_path, shard_size="2kb", compression=None))
    shard = sorted((Path(result.uri) / "train").glob("shard.*.mds"))[1]
    data = bytearray(shard.read_bytes())
    data[-8:] = bytes(8 - i for i in range(8))  # same size, different bytes
    shard.write_bytes(bytes(data))
    loader = build_dataloader(result.uri, "train", LoaderConfig(batch_size=8, shuffle=False))
    # streaming alone would end this epoch early and only log the error; the published
    # split's shards are checked against their index's sha1 before the first batch.
    with pytest.raises(
        DataError, match=rf"is damaged: shard .*/{shard.name}: its sha1 does not match its index"
    ):
        batch_ids(loader)


@pytest.mark.slow
@pytest.mark.alone  # other tests' runs would clean up the memory the crash leaves
def test_run_after_a_crashed_run_with_stale_shared_memory_starts_cleanly(clicks):
    # Killed with its process group after building its loader, a run leaves streaming's shared
    # memory behind, and plain streaming then refuses the split. (Killed after reading, it also
    # leaves lock files, which make streaming skip, and leak, that memory instead.)
    crashed = run_python(
        "from tests.unit.conftest_data import crash_reader_then_open_plainly as f; "
        f"f({clicks.uri!r}, 'train')",
        stdout=subprocess.PIPE,
    )
    out, _ = crashed.communicate(timeout=180)
    assert crashed.returncode == 0
    assert out.startswith("refused: Reused local directory")
    cache = str(stream_cache_dir(clicks.uri))
    stale = [p for p in SHM_DIR.glob("*_locals") if cache in p.read_bytes().decode(errors="ignore")]
    assert len(stale) == 1, "the killed reader should have left its shared memory"
    stale_inode = stale[0].stat().st_ino
    time.sleep(max(0.0, GRACE_S + 0.1 - (time.time() - stale[0].stat().st_mtime)))

    # build_dataloader removes what no live process uses, then reads the whole split.
    loader = build_dataloader(clicks.uri, "train", LoaderConfig(batch_size=8))
    # The stale file is gone (the new run may have registered a fresh one under the same name).
    assert not stale[0].exists() or stale[0].stat().st_ino != stale_inode
    assert sorted(_flat(batch_ids(loader))) == list(range(200))


def test_s3_output_is_uploaded_cached_and_streamed_back(tmp_path, s3_server):
    import boto3

    config = tabular_config(tmp_path, output_root="s3://datasets/prepared", shard_size="2kb")
    first = prepare_dataset(config)
    assert first.uri.startswith("s3://datasets/prepared/clicks-") and not first.cache_hit
    keys = [
        o["Key"]
        for o in boto3.client("s3", endpoint_url=s3_server).list_objects_v2(Bucket="datasets")[
            "Contents"
        ]
    ]
    prefix = first.uri.removeprefix("s3://datasets/")
    assert f"{prefix}/manifest.json" in keys and f"{prefix}/train/index.json" in keys
    assert sum(k.endswith(".mds.zstd") for k in keys) > 1

    assert prepare_dataset(config).cache_hit
    loader = build_dataloader(first.uri, "train", LoaderConfig(batch_size=16))
    assert sorted(_flat(batch_ids(loader))) == list(range(200))


_READ_AND_EXIT = """
import sys, tempfile
from trainflow.data import LoaderConfig, build_dataloader, read_whole_split
from trainflow.data.paths import stream_cache_dir
uri, read = sys.argv[1], sys.argv[2]
if read == "whole":
    ids = [int(s["id"]) for s in read_whole_split(uri, "train", batch_size=64)]
elif read == "loader":
    for _ in range(2):  # two datasets alive at once: two prefixes
        loader = build_dataloader(uri, "train", LoaderConfig(batch_size=64, shuffle=False))
        ids = [int(i) for batch in loader for i in batch["id"]]
else:  # streaming's own dataset, as build_dataloader opens it
    from streaming import StreamingDataset
    dataset = StreamingDataset(
        remote=uri, local=str(stream_cache_dir(uri)), split="train", batch_size=64
    )
    ids = sorted(int(s["id"]) for s in dataset)
assert ids == list(range(200)), ids
print(tempfile.gettempdir())
"""


@pytest.mark.parametrize("read", ["streaming", "loader", "whole"])
def test_a_process_that_read_with_our_loader_leaves_nothing_in_the_temp_folder(
    clicks, tmp_path, read
):
    # streaming leaves its lock files in the temp folder even when its reader exits cleanly
    # (its shared memory it releases at exit); a process that read with build_dataloader
    # removes its own at exit.
    temp = tmp_path / "temp"
    temp.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _READ_AND_EXIT, clicks.uri, read],
        cwd=REPO_ROOT,
        env={**os.environ, "TMPDIR": str(temp)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(temp)
    left = sorted(p.name for p in temp.iterdir())
    if read == "streaming":
        assert left and all(name.endswith("_filelock") for name in left), left
    else:
        assert left == []
