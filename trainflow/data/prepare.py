"""Prepare a dataset: source -> transform -> MDS shards, content-addressed and cached.

    from trainflow.data import load_preset, prepare_dataset
    result = prepare_dataset(load_preset("instructions"))
    result.uri, result.splits["train"].num_samples

The output directory is `<output_root>/<name>-<fingerprint[:16]>`, where the fingerprint covers
the source's content, the tokenizer's content and every option that changes the shards. A
second call with the same inputs finds the published manifest and does no work.
"""

import hashlib
import json
import logging
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainflow.data.config import (
    ChatTransform,
    DataConfig,
    PreparedDataset,
    SplitInfo,
    TextTransform,
)
from trainflow.data.paths import default_datasets_root, join_uri
from trainflow.data.sources import source_fingerprint
from trainflow.data.store import (
    FORMAT_VERSION,
    Out,
    Publication,
    check_writable,
    damage,
    publishing,
    read_manifest,
)
from trainflow.data.tokenizer import tokenizer_fingerprint

if TYPE_CHECKING:  # building imports them; finding a published dataset does not
    import datasets
    import pyarrow as pa

logger = logging.getLogger(__name__)

# Options that decide where and how fast a dataset is built, but not its content.
_NOT_CONTENT = {"output_root": True, "num_proc": True, "source": True}
# Rows turned from Arrow into samples at a time by a writer.
_WRITE_BATCH = 4096


def output_root(config: DataConfig) -> str:
    """The configured output root, else `$TRAINFLOW_DATASETS` or `$TRAINFLOW_HOME/datasets`."""
    return config.output_root or default_datasets_root()


def dataset_fingerprint(config: DataConfig) -> str:
    """Hash of everything that decides the shards' content (not file paths, not num_proc)."""
    exclude: dict[str, Any] = dict(_NOT_CONTENT)
    tokenizer = None
    if isinstance(config.transform, TextTransform | ChatTransform):
        exclude["transform"] = {"tokenizer": True}
        tokenizer = tokenizer_fingerprint(config.transform.tokenizer)
    payload = {
        "format_version": FORMAT_VERSION,
        "source": source_fingerprint(config.source),
        "tokenizer": tokenizer,
        "options": config.model_dump(mode="json", exclude=exclude),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def dataset_uri(config: DataConfig, fingerprint: str | None = None) -> str:
    """Where `config`'s dataset is (or will be) published."""
    fingerprint = fingerprint or dataset_fingerprint(config)
    return join_uri(output_root(config), f"{config.name}-{fingerprint[:16]}")


def find_published(config: DataConfig, fingerprint: str | None = None) -> PreparedDataset | None:
    """The already published dataset for `config`, or None.

    Args:
        config: What to look for.
        fingerprint: `dataset_fingerprint(config)` if the caller has it (hashing the source
            and tokenizer again costs a read of every file); None computes it.
    """
    fingerprint = fingerprint or dataset_fingerprint(config)
    uri = dataset_uri(config, fingerprint)
    manifest = _whole_manifest(uri, fingerprint)
    return None if manifest is None else _result(uri, manifest, cache_hit=True)


def _whole_manifest(uri: str, fingerprint: str) -> dict[str, Any] | None:
    """The manifest of the dataset published at `uri`, or None when there is none, it is of
    other content, or it is damaged (then it is rebuilt: the warning names what is wrong)."""
    manifest = read_manifest(uri)
    if manifest is None or manifest.get("fingerprint") != fingerprint:
        return None
    problem = damage(uri, manifest)
    if problem is not None:
        logger.warning("the published dataset %s is damaged (%s); rebuilding it", uri, problem)
        return None
    return manifest


def _result(uri: str, manifest: dict[str, Any], cache_hit: bool) -> PreparedDataset:
    splits = {name: SplitInfo(**info) for name, info in manifest["splits"].items()}
    return PreparedDataset(
        uri=uri,
        name=manifest["name"],
        fingerprint=manifest["fingerprint"],
        splits=splits,
        columns=manifest["columns"],
        num_bytes=sum(s.num_bytes for s in splits.values()),
        cache_hit=cache_hit,
    )


def _column_values(table: "pa.Table", column: str, encoding: str) -> Sequence[Any]:
    """One column of `table` as the values `MDSWriter` encodes, one per row.

    Lists become numpy views of the declared dtype into one flat buffer (no per-row Python
    lists), numbers numpy scalars, text, bytes and json Python objects.
    """
    import numpy as np

    chunked = table.column(column)
    if encoding.startswith("ndarray:"):
        lists = chunked.combine_chunks()
        flat = lists.flatten().to_numpy(zero_copy_only=False)
        flat = flat.astype(np.dtype(encoding.split(":", 1)[1]), copy=False)
        bounds = lists.offsets.to_numpy()
        bounds = bounds - bounds[0]  # a sliced array's offsets start inside its values
        return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if encoding in ("str", "bytes", "json"):
        return chunked.to_pylist()
    return chunked.to_numpy()


def _write_part(ds: "datasets.Dataset", columns: dict[str, str], out: Out, options: Any) -> None:
    """Write `ds`'s rows, in order, as one MDS dataset at `out` (runs in a writer process)."""
    from streaming import MDSWriter

    with MDSWriter(out=out, columns=columns, keep_local=True, exist_ok=True, **options) as writer:
        for table in ds.with_format("arrow").iter(batch_size=_WRITE_BATCH):
            values = [_column_values(table, c, t) for c, t in columns.items()]
            for row in zip(*values, strict=True):
                writer.write(dict(zip(columns, row, strict=True)))


def _write_split(
    publication: Publication,
    split: str,
    ds: "datasets.Dataset",
    columns: dict[str, str],
    config: DataConfig,
) -> None:
    """Write one split's rows in order: in this process, or in parts by parallel writers.

    With several processes each writes a contiguous part (`<split>/part-00000/`, ...) and
    streaming's `merge_index` joins their indexes into the split's `index.json`, parts in
    order, so readers see the same samples in the same order as from one writer. A writer that
    fails or dies fails the whole split, and nothing is published.
    """
    from streaming.base.util import merge_index

    from trainflow.data.transforms import num_processes

    options = {
        "compression": config.compression,
        "hashes": config.hashes,
        "size_limit": config.shard_size,
    }
    processes = num_processes(config, len(ds))
    if processes is None:
        _write_part(ds, columns, publication.out(split), options)
        return
    parts = [f"part-{i:05d}" for i in range(processes)]
    # Fork: the writers inherit the imported modules instead of importing torch again.
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = [
            pool.submit(
                _write_part,
                ds.shard(processes, i, contiguous=True),
                columns,
                publication.out(split, part),
                options,
            )
            for i, part in enumerate(parts)
        ]
        for future in futures:
            future.result()
    indexes = [publication.out(split, part, "index.json") for part in parts]
    merge_index(indexes, publication.out(split), keep_local=True)


def _split_bytes(split_dir: Path) -> int:
    index = json.loads((split_dir / "index.json").read_text())
    data = sum((s["zip_data"] or s["raw_data"])["bytes"] for s in index["shards"])
    return data + (split_dir / "index.json").stat().st_size


def prepare_dataset(config: DataConfig, fingerprint: str | None = None) -> PreparedDataset:
    """Build and publish the MDS dataset for `config`, or return the published one.

    All splits are loaded and transformed before any shard is written, so bad input fails
    before the output location is touched.

    Args:
        config: What to prepare.
        fingerprint: `dataset_fingerprint(config)` if the caller has it; None computes it.

    Returns:
        The published dataset's URI, per-split counts and sizes, and column types;
        `cache_hit` is True when nothing had to be built.

    Raises:
        DataError: On bad input (missing file, column or split, empty split, wrong type,
            tokenizer without chat template, output root not writable, more processes than
            cores).
    """
    from trainflow.data.checks import check_num_proc

    check_num_proc(config.num_proc)
    root = output_root(config)
    check_writable(root)
    fingerprint = fingerprint or dataset_fingerprint(config)
    uri = dataset_uri(config, fingerprint)
    manifest = _whole_manifest(uri, fingerprint)
    if manifest is not None:
        logger.info("cache hit: %s is already published; nothing to do", uri)
        return _result(uri, manifest, cache_hit=True)

    from trainflow.data.sources import load_source
    from trainflow.data.tokenizer import load_tokenizer
    from trainflow.data.transforms import apply_transform, output_columns

    tokenizer = None
    if isinstance(config.transform, TextTransform | ChatTransform):
        tokenizer = load_tokenizer(
            config.transform.tokenizer, need_chat_template=config.transform.name == "chat"
        )
    columns = output_columns(config)
    splits = load_source(config)
    transformed = {
        split: apply_transform(config, split, ds, tokenizer) for split, ds in splits.items()
    }

    manifest = {
        "format_version": FORMAT_VERSION,
        "name": config.name,
        "fingerprint": fingerprint,
        "columns": columns,
        "hashes": config.hashes,
        "compression": config.compression,
        "config": config.model_dump(mode="json"),
        "splits": {},
    }
    logger.info(
        "building %s (%s)", uri, ", ".join(f"{s}: {len(d)}" for s, (d, _) in transformed.items())
    )
    with publishing(uri, manifest) as publication:
        for split, (ds, num_dropped) in transformed.items():
            _write_split(publication, split, ds, columns, config)
            manifest["splits"][split] = {
                "num_samples": len(ds),
                "num_dropped": num_dropped,
                "num_bytes": _split_bytes(publication.local_split_dir(split)),
            }
    logger.info("published %s", uri)
    return _result(uri, manifest, cache_hit=False)


def prepare_ahead(config: dict[str, Any]) -> dict[str, Any]:
    """`prepare_dataset` for a launch's standby agent, JSON in and out
    (`trainflow.data.ahead`). A `DataError` (a `ValueError`) is the agent's `refused`."""
    return prepare_dataset(DataConfig.model_validate(config)).model_dump(mode="json")
