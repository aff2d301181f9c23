"""A damaged cached copy of a shard is never trained on: it is fetched again from the published
dataset, and a damaged published shard fails the read naming the shard.

Real MDS shards, a real `streaming` cache; single bytes flipped in the files on disk.
"""

import gc
import random
from pathlib import Path

import pytest

from tests.unit.conftest_data import chat_config
from trainflow.data import DataError, LoaderConfig, build_dataloader, prepare_dataset
from trainflow.data.paths import stream_cache_dir

NUM_OFFSETS = 24


def _read_all(uri: str) -> list[tuple[int, bytes, bytes]]:
    loader = build_dataloader(uri, "train", LoaderConfig(batch_size=16, shuffle=False))
    rows = [
        (int(i), ids.numpy().tobytes(), mask.numpy().tobytes())
        for batch in loader
        for i, ids, mask in zip(
            batch["id"], batch["input_ids"], batch["assistant_masks"], strict=True
        )
    ]
    del loader
    gc.collect()  # streaming allows one open dataset per cache folder
    return rows


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("integrity")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAINFLOW_HOME", str(tmp / "home"))
        result = prepare_dataset(chat_config(tmp, num_rows=96))
        yield result.uri, tmp / "home"


def test_bytes_flipped_in_the_cached_shard_are_fetched_again_never_read(published, monkeypatch):
    uri, home = published
    monkeypatch.setenv("TRAINFLOW_HOME", str(home))
    reference = _read_all(uri)  # fills the cache
    cached = stream_cache_dir(uri) / "train"
    shards = sorted(cached.glob("shard.*.mds"))
    assert shards, list(cached.iterdir())
    size = shards[0].stat().st_size
    offsets = sorted(random.Random(0).sample(range(size), NUM_OFFSETS))
    for offset in offsets:
        _flip(shards[0], offset)
        assert _read_all(uri) == reference, f"offset {offset}"
    # Every damaged copy was replaced by the published one.
    published_raw = Path(uri) / "train" / shards[0].name
    if published_raw.is_file():
        assert shards[0].read_bytes() == published_raw.read_bytes()


def test_a_damaged_published_shard_fails_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path / "home"))
    result = prepare_dataset(chat_config(tmp_path, num_rows=96))
    shard = sorted((Path(result.uri) / "train").glob("shard.*"))[0]
    _flip(shard, shard.stat().st_size // 2)
    with pytest.raises(DataError, match=shard.name):
        _read_all(result.uri)


def test_bytes_flipped_in_the_cached_copy_of_an_s3_dataset_are_fetched_again(
    tmp_path, monkeypatch, s3_server
):
    """The same check for a dataset published to a bucket (a real S3 API, moto, on loopback):
    the damaged cached copy is fetched again from the bucket, never read."""
    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path / "home"))
    result = prepare_dataset(
        chat_config(tmp_path, num_rows=96, output_root="s3://datasets/prepared")
    )
    reference = _read_all(result.uri)
    cached = stream_cache_dir(result.uri) / "train"
    shard = sorted(cached.glob("shard.*.mds"))[0]
    offsets = sorted(random.Random(1).sample(range(shard.stat().st_size), 6))
    for offset in offsets:
        _flip(shard, offset)
        assert _read_all(result.uri) == reference, f"offset {offset}"
