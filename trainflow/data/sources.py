"""Read a source into a `datasets.DatasetDict`, choose splits, and fingerprint the source."""

import hashlib
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from trainflow.data.checks import check_files
from trainflow.data.config import DataConfig, FileSource, HubSource, ValidationSplit
from trainflow.data.errors import DataError
from trainflow.data.paths import hf_cache_dir

if TYPE_CHECKING:  # loading imports it; fingerprinting a source does not
    import datasets


@lru_cache(maxsize=256)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_fingerprint(source: FileSource | HubSource) -> str:
    """Hash of what the source contains: file contents (not paths), or a Hub commit.

    Args:
        source: The configured source.

    Returns:
        A string that changes whenever the source's rows can change.

    Raises:
        DataError: If a Hub dataset's revision cannot be resolved (for example, no network).
    """
    if isinstance(source, FileSource):
        parts = [f"format={source.format}"]
        for split in sorted(source.files):
            for path in source.files[split]:
                stat = Path(path).stat()
                parts.append(f"{split}:{_file_digest(path, stat.st_size, stat.st_mtime_ns)}")
        return "files:" + hashlib.sha256("\n".join(parts).encode()).hexdigest()
    from huggingface_hub import HfApi

    try:
        sha = HfApi().dataset_info(source.name, revision=source.revision).sha
    except Exception as err:  # no network, unknown or gated dataset...
        raise DataError(
            f"hub dataset {source.name!r} (revision {source.revision or 'main'}) could not be "
            f"resolved: {err}"
        ) from err
    return f"hub:{source.name}/{source.subset or ''}@{sha}"


def _describe(source: FileSource | HubSource, split: str) -> str:
    if isinstance(source, FileSource):
        return f"split {split!r} ({', '.join(source.files.get(split, []))})"
    return f"split {split!r} of hub dataset {source.name!r}"


def load_source(config: DataConfig) -> "datasets.DatasetDict":
    """Load the source, keep the configured splits and carve the validation split.

    Args:
        config: The data config.

    Returns:
        One non-empty `Dataset` per output split.

    Raises:
        DataError: If the files cannot be parsed, a split is missing or a split is empty; the
            message names the split and its files.
    """
    import datasets

    source = config.source
    cache = str(hf_cache_dir())
    check_files(config)
    try:
        if isinstance(source, FileSource):
            loaded = datasets.load_dataset(source.format, data_files=source.files, cache_dir=cache)
        else:
            loaded = datasets.load_dataset(
                source.name, source.subset, revision=source.revision, cache_dir=cache
            )
    except Exception as err:  # pyarrow/pandas/json parse errors, hub errors...
        where = source.files if isinstance(source, FileSource) else source.name
        raise DataError(f"source {where} could not be loaded: {err}") from err

    if config.splits is not None:
        missing = [s for s in config.splits if s not in loaded]
        if missing:
            raise DataError(f"split(s) {missing} not in source; it has {sorted(loaded)}")
        loaded = datasets.DatasetDict({s: loaded[s] for s in config.splits})

    for split, ds in loaded.items():
        if len(ds) == 0:
            raise DataError(f"{_describe(source, split)} is empty")

    for field, carve in (("test", config.test), ("validation", config.validation)):
        if carve is not None:
            _carve(loaded, carve, field, source)
    return loaded


def _carve(
    loaded: "datasets.DatasetDict", val: ValidationSplit, field: str, source: FileSource | HubSource
) -> None:
    """Move `val.fraction` of `val.from_split` into the new split `val.name`, in place: at
    random, or the rows last in `val.order_column` (nothing later is left behind)."""
    if val.from_split not in loaded:
        raise DataError(f"{field}.from_split {val.from_split!r} not in {sorted(loaded)}")
    if val.name in loaded:
        raise DataError(f"{field}.name {val.name!r} is already a split of the source")
    rows = loaded[val.from_split]
    if val.order_column is None:
        parts = rows.train_test_split(test_size=val.fraction, seed=val.seed)
        kept, moved = parts["train"], parts["test"]
    else:
        if val.order_column not in rows.column_names:
            raise DataError(
                f"{field}.order_column {val.order_column!r} is not a column of "
                f"{_describe(source, val.from_split)}; it has {rows.column_names}"
            )
        ordered = rows.sort(val.order_column)
        cut = len(rows) - holdout_size(len(rows), val.fraction)
        kept, moved = ordered.select(range(cut)), ordered.select(range(cut, len(rows)))
    for split, ds in ((val.from_split, kept), (val.name, moved)):
        if len(ds) == 0:
            raise DataError(
                f"split {split!r} would be empty after moving fraction {val.fraction} of "
                f"{_describe(source, val.from_split)} to {val.name}"
            )
    loaded[val.from_split] = kept
    loaded[val.name] = moved


def holdout_size(num_rows: int, fraction: float) -> int:
    """Rows an ordered split moves out of `num_rows` (rounded down: never more than asked)."""
    return int(num_rows * fraction)


def describe_split(config: DataConfig, split: str) -> str:
    """Human description of a split and where it came from, for error messages."""
    return _describe(config.source, split)
