"""Read a source into a `datasets.DatasetDict`, choose splits, and fingerprint the source."""

import hashlib
import json
from functools import lru_cache
from pathlib import Path

import datasets

from trainflow.data.config import DataConfig, FileSource, HubSource
from trainflow.data.errors import DataError
from trainflow.data.paths import hf_cache_dir


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


def check_json_rows(path: Path, split: str) -> None:
    """Check a JSON Lines (or one JSON array) file row by row before `datasets` parses it.

    `datasets` reports a bad row without its line ("An error occurred while generating the
    dataset", "position 59"); here the first bad row is named by line and column.

    Raises:
        DataError: a row that is not UTF-8, not JSON or not an object, or a file with no rows.
    """
    data = path.read_bytes()
    where = f"file {path} of split {split!r}"
    if data.lstrip()[:1] == b"[":  # one JSON array of rows
        try:
            rows = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            at = f"line {err.lineno}, column {err.colno}" if hasattr(err, "lineno") else "it"
            raise DataError(f"{where}: {at} is not valid JSON ({err})") from None
        if not rows:
            raise DataError(f"{where} has no rows (an empty JSON array)")
        return
    count = 0
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise DataError(f"{where}: line {number} is not UTF-8 text") from None
        except json.JSONDecodeError as err:
            raise DataError(
                f"{where}: line {number}, column {err.colno} is not valid JSON ({err.msg})"
            ) from None
        if not isinstance(row, dict):
            raise DataError(
                f"{where}: line {number} is a JSON {type(row).__name__}, not an object of columns"
            )
        count += 1
    if count == 0:
        raise DataError(f"{where} has no rows: every line is blank")


def load_source(config: DataConfig) -> datasets.DatasetDict:
    """Load the source, keep the configured splits and carve the validation split.

    Args:
        config: The data config.

    Returns:
        One non-empty `Dataset` per output split.

    Raises:
        DataError: If the files cannot be parsed, a split is missing or a split is empty; the
            message names the split and its files.
    """
    source = config.source
    cache = str(hf_cache_dir())
    if isinstance(source, FileSource):
        for split, paths in source.files.items():
            for path in paths:
                if Path(path).stat().st_size == 0:
                    raise DataError(f"file {path} of split {split!r} is empty")
                if source.format == "json":
                    check_json_rows(Path(path), split)
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

    if config.validation is not None:
        val = config.validation
        if val.from_split not in loaded:
            raise DataError(f"validation.from_split {val.from_split!r} not in {sorted(loaded)}")
        if val.name in loaded:
            raise DataError(f"validation.name {val.name!r} is already a split of the source")
        parts = loaded[val.from_split].train_test_split(test_size=val.fraction, seed=val.seed)
        for split, ds in ((val.from_split, parts["train"]), (val.name, parts["test"])):
            if len(ds) == 0:
                raise DataError(
                    f"split {split!r} would be empty after moving fraction {val.fraction} of "
                    f"{_describe(source, val.from_split)} to validation"
                )
        loaded[val.from_split] = parts["train"]
        loaded[val.name] = parts["test"]
    return loaded


def describe_split(config: DataConfig, split: str) -> str:
    """Human description of a split and where it came from, for error messages."""
    return _describe(config.source, split)
