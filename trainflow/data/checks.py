"""Checks of local source files that run before anything is loaded, converted or started.

Light on purpose (no `datasets`, torch or pyarrow until a Parquet file is met): pipelines run
them on the command line before a Prefect server or any rank starts, so a bad file fails in
about a second with its line and column, not minutes later inside a conversion.
"""

import csv
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from trainflow.data.config import (
    ChatTransform,
    DataConfig,
    DetectionTransform,
    FileSource,
    TabularTransform,
    TextTransform,
)
from trainflow.data.errors import DataError


def needed_columns(config: DataConfig) -> list[str]:
    """The source columns the transform and `id_column` read (empty when not known here)."""
    transform = config.transform
    if isinstance(transform, TabularTransform):
        names = list(transform.columns)
    elif isinstance(transform, TextTransform):
        names = [transform.text_column, *transform.keep_columns]
    elif isinstance(transform, ChatTransform):
        names = [transform.messages_column, *transform.keep_columns]
    elif isinstance(transform, DetectionTransform):
        names = [transform.image_column, transform.boxes_column, transform.labels_column]
    else:
        names = []
    if config.id_column and names:
        names.append(config.id_column)
    return names


def check_files(config: DataConfig) -> None:
    """Check local source files before anything is loaded, converted or started.

    Cheap (one pass over JSON rows, the header of a CSV, the schema of a Parquet file), so
    pipelines run it before a Prefect server or any rank starts.

    Raises:
        DataError: naming the file, its split and, for a bad row, the line: an empty file, a
            file with no rows, a row that does not parse, or a column the transform needs
            that the file does not have.
    """
    source = config.source
    if not isinstance(source, FileSource):
        return
    columns = needed_columns(config)
    for split, paths in source.files.items():
        for path in map(Path, paths):
            if not path.is_file():
                raise DataError(f"file {path} of split {split!r} does not exist")
            if path.stat().st_size == 0:
                raise DataError(f"file {path} of split {split!r} is empty")
            if source.format == "json":
                check_json_rows(path, split, columns)
            elif source.format == "csv":
                _check_csv(path, split, columns)
            elif source.format == "parquet":
                _check_parquet(path, split, columns)


def _missing(where: str, wanted: list[str], has: list[str]) -> DataError:
    missing = [c for c in wanted if c not in has]
    return DataError(f"{where} has no column {missing[0]!r}, which the config reads; it has {has}")


def _check_csv(path: Path, split: str, columns: list[str]) -> None:
    where = f"file {path} of split {split!r}"
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        if not any(cell.strip() for cell in header):
            raise DataError(f"{where} has no header row")
        if next(reader, None) is None:
            raise DataError(f"{where} has a header but no rows")
    if set(columns) - set(header):
        raise _missing(where, columns, header)


def _check_parquet(path: Path, split: str, columns: list[str]) -> None:
    import pyarrow.parquet as pq

    where = f"file {path} of split {split!r}"
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as err:  # pyarrow raises ArrowInvalid and friends on a damaged file
        raise DataError(f"{where} is not a readable Parquet file ({err})") from None
    if meta.num_rows == 0:
        raise DataError(f"{where} has no rows")
    names = meta.schema.to_arrow_schema().names  # top-level columns, not nested leaves
    if set(columns) - set(names):
        raise _missing(where, columns, names)


def check_json_rows(path: Path, split: str, columns: Sequence[str] = ()) -> None:
    """Check a JSON Lines (or one JSON array) file row by row before `datasets` parses it.

    `datasets` reports a bad row without its line ("An error occurred while generating the
    dataset", "position 59"); here the first bad row is named by line and column.

    Raises:
        DataError: a row that is not UTF-8, not JSON or not an object, a row without one of
            `columns`, or a file with no rows.
    """
    where = f"file {path} of split {split!r}"
    with open(path, "rb") as f:
        start = f.read(4096).lstrip()
    if start[:1] == b"[":  # one JSON array of rows: it parses only as a whole
        try:
            rows = json.loads(path.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            at = (
                f"line {err.lineno}, column {err.colno}"
                if isinstance(err, json.JSONDecodeError)
                else "it"
            )
            raise DataError(f"{where}: {at} is not valid JSON ({err})") from None
        if not rows:
            raise DataError(f"{where} has no rows (an empty JSON array)")
        for number, row in enumerate(rows, start=1):
            if not isinstance(row, dict):
                raise DataError(
                    f"{where}: row {number} is a JSON {type(row).__name__}, not an object"
                )
            if set(columns) - set(row):
                raise _missing(f"{where}: row {number}", list(columns), list(row))
        return
    with open(path, "rb") as f:  # JSON Lines: one line in memory at a time
        count = _check_lines(f, where, columns)
    if count == 0:
        raise DataError(f"{where} has no rows: every line is blank")


def _check_lines(lines: Iterable[bytes], where: str, columns: Sequence[str]) -> int:
    """The number of rows in JSON Lines `lines`; raises on the first bad one."""
    count = 0
    for number, line in enumerate(lines, start=1):
        raw = line.rstrip(b"\r\n")
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
        if set(columns) - set(row):
            raise _missing(f"{where}: line {number}", list(columns), list(row))
        count += 1
    return count
