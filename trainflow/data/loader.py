"""Read a prepared split inside a rank: `StreamingDataset` + `StreamingDataLoader`, resumable.

    from trainflow.data import LoaderConfig, build_dataloader
    loader = build_dataloader(uri, "train", LoaderConfig(batch_size=8, seed=0))
    for batch in loader: ...
    state = loader.state_dict()               # save with the checkpoint (same on every rank)
    loader = build_dataloader(uri, "train", cfg, state=state)   # continues at that sample

Partitioning comes from the launcher's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`LOCAL_WORLD_SIZE`), which `streaming` reads itself. The sample order is a function of the
seed and `num_canonical_nodes` only, so a run resumed on a different number of ranks continues
the same global order. No Prefect here: this runs on every rank.
"""

import atexit
import contextlib
import json
import logging
import os
import queue
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from streaming import StreamingDataLoader, StreamingDataset

from trainflow.data.config import LoaderConfig
from trainflow.data.errors import DataError
from trainflow.data.paths import is_remote, join_uri, stream_cache_dir
from trainflow.data.shm import (
    clean_stale_streaming_state,
    registering,
    release_streaming_state_since,
    streaming_prefixes,
)
from trainflow.data.store import damage, mark_damaged, read_index, read_manifest

logger = logging.getLogger(__name__)

_STATE_KEYS = {"epoch", "sample_in_epoch", "num_canonical_nodes", "shuffle_seed"}


class PadCollate:
    """Collate samples into tensors, right-padding variable-length 1-D arrays.

    Each padded column is filled into one numpy buffer of its own dtype and handed to torch
    without a copy (one tensor per batch, not one per sample).

    Args:
        pad_values: Padding value per column (default 0), e.g.
            `{"input_ids": tokenizer.pad_token_id}`; it must fit the column's dtype.
    """

    def __init__(self, pad_values: dict[str, int] | None = None) -> None:
        self.pad_values = pad_values or {}

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor | list[str]]:
        batch: dict[str, torch.Tensor | list[str]] = {}
        for key in samples[0]:
            values = [s[key] for s in samples]
            first = values[0]
            if isinstance(first, str):
                batch[key] = values
            elif isinstance(first, np.ndarray) and first.ndim == 1:
                lengths = [len(v) for v in values]
                padded = np.full(
                    (len(values), max(lengths)), self.pad_values.get(key, 0), dtype=first.dtype
                )
                for row, value, length in zip(padded, values, lengths, strict=True):
                    row[:length] = value
                batch[key] = torch.from_numpy(padded)
            else:
                batch[key] = torch.as_tensor(np.stack(values))
        return batch


class _CheckedStreamingDataset(StreamingDataset):
    """`StreamingDataset` whose failed shard download or hash check fails the epoch as a
    `DataError` naming the split and the shard.

    `streaming` downloads and checks shards in background threads and raises a failed
    thread's error from `__iter__` as a `RuntimeError` that chains it. (`mosaicml-streaming`
    0.13 instead ended the epoch early and only logged it: docs/data.md.)
    """

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            yield from super().__iter__()
        except RuntimeError as error:
            if error.__cause__ is None:
                raise
            stream = self.streams[0]
            remote, split = str(stream.remote), str(stream.split)
            if not is_remote(remote):
                # Name (and mark) the published shard if it is the one damaged, not the
                # cached copy streaming names.
                verify_published_split(remote, split)
            cause = str(error.__cause__).replace(str(stream.local), remote)
            raise DataError(
                f"reading split {split!r} of {remote} stopped early: {cause}"
            ) from error.__cause__


class _ReadAhead:
    """Iterate `source` in a daemon thread, at most `depth` items ahead of the consumer.

    An error in the thread is raised to the consumer at the item where it happened. `close`
    (also when the consumer stops early: the Trainer leaves an epoch at `max_steps`) stops
    the thread after the item it is reading.
    """

    _END = object()
    # How often a thread waiting for room in the queue looks whether it was closed.
    _POLL_S = 0.1

    def __init__(self, source: Iterator[Any], depth: int) -> None:
        self._items: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue(depth)
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._fill, args=(source,), name="trainflow-read-ahead", daemon=True
        )
        self._thread.start()

    def _fill(self, source: Iterator[Any]) -> None:
        try:
            for item in source:
                if not self._put((item, None)) or self._closed.is_set():
                    return
            self._put((self._END, None))
        except BaseException as error:  # handed to the consumer, raised there
            self._put((self._END, error))

    def _put(self, entry: tuple[Any, BaseException | None]) -> bool:
        while not self._closed.is_set():
            try:
                self._items.put(entry, timeout=self._POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Any]:
        while True:
            item, error = self._items.get()
            if error is not None:
                raise error
            if item is self._END:
                return
            yield item

    def close(self) -> None:
        self._closed.set()
        # The thread is most likely waiting for room in the full queue: make room, so that it
        # stops now rather than at its next look (the Trainer leaves its last epoch inside the
        # time it reports as `train_runtime`).
        with contextlib.suppress(queue.Empty):
            self._items.get_nowait()
        self._thread.join(timeout=5.0)


class ResumableLoader(StreamingDataLoader):
    """`StreamingDataLoader` that reads ahead in a thread and refuses a resume state it would
    silently ignore.

    With `prefetch` > 0 (and no worker processes) a background thread reads and collates the
    next `prefetch` batches while the caller trains on the current one: the shard reads, the
    decoding and the padding run while the training thread waits on its collectives or runs
    backward (which releases the GIL), instead of in front of each step. The order is the same
    and `state_dict` counts only the batches handed out, so a resume continues right after the
    last batch trained on, not after the ones read ahead.
    """

    def __init__(self, *args: Any, prefetch: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefetch = prefetch
        self._started: _ReadAhead | None = None

    def _reads_ahead(self) -> bool:
        return self.prefetch > 0 and self.num_workers == 0

    def start_reading(self) -> None:
        """Begin the next epoch's read-ahead now, for the next `iter(loader)` to pick up.

        Opening an epoch (streaming's partition and shard setup) and its first batches then
        overlap whatever the rank does before it trains (building its Trainer, wrapping the
        model) instead of delaying the first step. Call it right before handing the loader to
        the training loop: the epoch counts as started from here on (`state_dict`). A no-op
        without read-ahead, or when an epoch's read-ahead is already waiting.
        """
        if self._reads_ahead() and self._started is None:
            self._started = _ReadAhead(super(StreamingDataLoader, self).__iter__(), self.prefetch)

    # A generator, as `StreamingDataLoader.__iter__` (`Iterator[Any]`) already is: torch's
    # `DataLoader.__iter__` is annotated with its own `_BaseDataLoaderIter`, which no subclass
    # that yields can return, so mypy checks this override against that annotation too.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if not self._reads_ahead():
            yield from super().__iter__()
            return
        self.num_samples_yielded = 0
        self.start_reading()
        ahead, self._started = self._started, None
        assert ahead is not None
        try:
            for batch in ahead:
                self.num_samples_yielded += self._get_batch_size(batch)
                yield batch
        finally:
            ahead.close()

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        """Resume at `obj['sample_in_epoch']` of `obj['epoch']` on the next iteration.

        Raises:
            DataError: If the state is malformed, or this loader already started a later epoch
                (`streaming` would then quietly start from sample 0).
        """
        missing = _STATE_KEYS - set(obj)
        if missing:
            raise DataError(f"loader state is missing {sorted(missing)}; got keys {sorted(obj)}")
        dataset = self.dataset
        assert isinstance(dataset, StreamingDataset)
        if dataset.next_epoch > obj["epoch"]:
            raise DataError(
                f"loader state is for epoch {obj['epoch']} but this loader already started epoch "
                f"{dataset.next_epoch - 1}; build a new loader with state=... to resume"
            )
        super().load_state_dict(obj)


# Cached shard files found intact in this process: path -> (file stamp, what was expected).
_verified: dict[Path, tuple[tuple[int, ...], tuple[Any, ...]]] = {}


def _stamp(path: Path) -> tuple[int, ...]:
    """What changes whenever a file is written or replaced."""
    stat = path.stat()
    return (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev)


def _file_problem(path: Path, info: dict[str, Any], algos: Sequence[str]) -> str | None:
    """What is wrong with one shard file against its index entry (`raw_data`/`zip_data`):
    its size, or its hash in the first of `algos` the index has; None when intact.

    A file found intact is remembered with its stamp and not read again while that holds.
    """
    from streaming.base.hashing import get_hash

    hashes = info.get("hashes") or {}
    algo = next((a for a in algos if a in hashes), None)
    expected = (info["bytes"], algo, hashes.get(algo) if algo else None)
    stamp = _stamp(path)
    if _verified.get(path) == (stamp, expected):
        return None
    _verified.pop(path, None)
    data = path.read_bytes()
    if len(data) != info["bytes"]:
        return f"{len(data)} bytes; its index says {info['bytes']}"
    if algo is not None and get_hash(algo, data) != hashes[algo]:
        return f"its {algo} does not match its index"
    _verified[path] = (stamp, expected)
    return None


def verify_published_split(uri: str, split: str) -> None:
    """Check every shard file of a split of the local published dataset at `uri` against the
    hashes in its index, as `streaming` does for the copies it fetches.

    For readers that read the published files in place (`streaming.LocalDataset`). A damaged
    dataset is marked so (`store.mark_damaged`), and the next prepare rebuilds it. A file
    checked intact earlier in this process is not read again while it is unchanged.

    Raises:
        DataError: naming the damaged or missing file, or when `uri` holds no dataset or split.
    """
    manifest = read_manifest(uri)
    if manifest is None:
        raise DataError(f"no published dataset at {uri} (its manifest.json is missing)")
    if split not in manifest["splits"]:
        raise DataError(
            f"split {split!r} not in dataset {uri}; it has {sorted(manifest['splits'])}"
        )
    folder = Path(uri) / split
    index = read_index(uri, split)
    if index is None:
        _damaged(uri, f"{folder / 'index.json'} is missing")
    for shard in json.loads(index)["shards"]:
        files = [info for info in (shard.get("raw_data"), shard.get("zip_data")) if info]
        present = [info for info in files if (folder / info["basename"]).is_file()]
        if not present:
            _damaged(uri, f"{folder / files[0]['basename']} is missing")
        for info in present:
            path = folder / info["basename"]
            problem = _file_problem(path, info, manifest.get("hashes") or [])
            if problem is not None:
                _damaged(uri, f"shard {path}: {problem}")


def _damaged(uri: str, problem: str) -> NoReturn:
    """Mark the published dataset at `uri` damaged and raise, naming `problem`."""
    mark_damaged(uri, problem)
    raise DataError(
        f"the published dataset {uri} is damaged: {problem}. It is marked damaged; the next "
        "prepare of it (the next run) rebuilds it"
    )


def verify_cached_split(uri: str, split: str, cache: Path, algos: Sequence[str]) -> list[str]:
    """Remove cached copies of a split's files that no longer match the published dataset.

    `streaming` checks a shard's hash only when it copies the shard from the published dataset
    into the local cache; a cached copy damaged later (a bad disk, a stray write) would be read
    as it is. Each cached shard file (compressed and raw) is checked here against the hash in
    the published index, or its size when the dataset has no hashes, and a cached index
    against the published one. What does not match is deleted, so `streaming` fetches it again
    from the published copy and checks that copy's hash as it does.

    A file checked intact earlier in this process is not read again while its size, times
    and inode are unchanged (any write to it changes them), so building loaders again and
    again (an evaluation each epoch) costs one hash per shard and process, not one per build.

    Call once per node (local rank 0) before the split is opened. Returns the files removed.
    """
    folder = cache / split
    cached_index = folder / "index.json"
    if not cached_index.is_file():
        return []
    published = read_index(uri, split)
    removed: list[str] = []
    if published is None or cached_index.read_bytes() != published:
        # The cache belongs to what is published now, or nothing in it can be trusted.
        shutil.rmtree(folder, ignore_errors=True)
        logger.warning("cached index of %s differs from the published one; fetching again", split)
        return [str(folder)]
    for shard in json.loads(published)["shards"]:
        for key in ("raw_data", "zip_data"):
            info = shard.get(key)
            path = folder / info["basename"] if info else None
            if path is None or not path.is_file():
                continue
            if _file_problem(path, info, algos) is not None:
                path.unlink()
                removed.append(str(path))
    if removed:
        logger.warning(
            "cached shard file(s) %s of %s are damaged; fetching them again from %s",
            [Path(p).name for p in removed],
            split,
            uri,
        )
    return removed


# The `streaming` prefixes present before this process built its first loader (None: none yet).
_loaders_began: set[str] | None = None


def _release_loaders_state() -> None:
    if _loaders_began is not None:
        release_streaming_state_since(_loaders_began)


def _release_at_exit() -> None:
    """Have this process remove, when it exits, the lock files its loaders' datasets leave.

    `streaming` keeps a dataset's shared memory until its process exits (its exit handlers
    release it) and leaves the dataset's lock files (`<tmp>/<prefix>_*_filelock`) even then.
    Registered before this process's first dataset exists, the handler runs after every
    dataset's own (last registered, first run), so only prefixes that no process maps any more
    are removed: another process's live dataset keeps its files. A launch's ranks keep theirs
    in the launch's temp folder, removed with it; this covers any other process (a pipeline's
    own, a script, a notebook's kernel).
    """
    global _loaders_began
    if _loaders_began is None:
        _loaders_began = streaming_prefixes()
        atexit.register(_release_loaders_state)


def build_dataloader(
    uri: str,
    split: str,
    config: LoaderConfig,
    *,
    state: dict[str, Any] | None = None,
    collate_fn: Callable[[list[dict[str, Any]]], Any] | None = None,
) -> ResumableLoader:
    """Build this rank's loader over one split of a published dataset.

    Args:
        uri: Published dataset (`PreparedDataset.uri`): local path or `s3://` URI.
        split: Split to read, e.g. 'train'.
        config: Batch size per rank, shuffle, seed and the rest.
        state: A `loader.state_dict()` saved earlier, to continue exactly after it.
        collate_fn: Batch collation; defaults to `PadCollate()`.

    Returns:
        The loader; its `state_dict()` / `load_state_dict()` give exact mid-epoch resume.

    Raises:
        DataError: If `uri` holds no complete dataset or has no such split.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        # streaming would create and destroy a group per call, and a second one on the same
        # store reads the first one's stale addresses and fails to connect.
        raise DataError(
            f"reading on {world_size} ranks needs the default process group: launch with "
            "@distributed(..., init_process_group=True) or wrap in runtime.process_group()"
        )
    manifest = read_manifest(uri)
    if manifest is None:
        raise DataError(f"no published dataset at {uri} (its manifest.json is missing)")
    if split not in manifest["splits"]:
        raise DataError(
            f"split {split!r} not in dataset {uri}; it has {sorted(manifest['splits'])}"
        )
    if (problem := damage(uri, manifest)) is not None:
        raise DataError(
            f"the published dataset {uri} is damaged: {problem}. The next prepare of it (the "
            "next run) rebuilds it"
        )
    _release_at_exit()
    local_leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if local_leader:
        verify_cached_split(uri, split, stream_cache_dir(uri), manifest.get("hashes") or [])
    # One launch at a time registers its dataset's shared memory on this machine: rank 0 holds
    # the lock, and the barriers keep the other ranks' own picks of the prefix inside its hold.
    with registering(int(os.environ.get("RANK", "0")) == 0):
        if local_leader and config.clean_stale_shared_memory:
            clean_stale_streaming_state()
        if dist.is_initialized():
            dist.barrier()
        dataset = _CheckedStreamingDataset(
            remote=uri,
            local=str(stream_cache_dir(uri)),
            split=split,
            batch_size=config.batch_size,
            shuffle=config.shuffle,
            shuffle_seed=config.seed,
            num_canonical_nodes=config.num_canonical_nodes,
            # streaming's default (8 batches) keeps its two background threads stepping
            # alongside the reader, taking a file lock per sample (~1 ms of held GIL each): a
            # third of the read rate. With the whole split allowed ahead, they run through this
            # rank's samples once, preparing each shard in order, and stop.
            predownload=manifest["splits"][split]["num_samples"],
            validate_hash=manifest["hashes"][0]
            if config.validate_hash and manifest["hashes"]
            else None,
        )
        if dist.is_initialized():
            dist.barrier()  # every rank has attached before another launch picks
    logger.debug("reading %s (%d samples)", join_uri(uri, split), dataset.num_samples)
    loader = ResumableLoader(
        dataset,
        batch_size=config.batch_size,
        num_workers=config.num_workers,
        drop_last=config.drop_last,
        collate_fn=collate_fn or PadCollate(),
        prefetch=config.prefetch,
    )
    if state is not None:
        loader.load_state_dict(state)
    return loader


def read_whole_split(uri: str, split: str, batch_size: int = 256) -> list[dict[str, Any]]:
    """Every sample of a split, in stored order, read in this process (one reader, no process
    group): for the orchestrating process, which needs a whole split (evaluation, a lookup
    table). Ranks stream their own partitions with `build_dataloader` instead.

    Raises:
        DataError: as `build_dataloader`.
    """
    read_all = LoaderConfig(batch_size=batch_size, shuffle=False)
    loader = build_dataloader(uri, split, read_all, collate_fn=list)
    return [sample for batch in loader for sample in batch]
