"""Checks of local source files that run before anything is loaded, converted or started.

Light on purpose (no `datasets`, torch or pyarrow until a Parquet file is met): pipelines run
them on the command line before a Prefect server or any rank starts, so a bad file fails in
about a second with its line and column, not minutes later inside a conversion.
"""

import csv
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

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


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity, not the machine's total)."""
    return len(os.sched_getaffinity(0))


def check_num_proc(num_proc: int | None, option: str = "num_proc") -> None:
    """Refuse more conversion processes than this process has cores, before any start.

    Each process costs its start-up, memory and a copy of the tokenizer, and converts no
    faster than a core: past one per core they only add up (a figure in the thousands runs
    the machine out of processes and file handles).

    Raises:
        DataError: naming `option`, the figure and the limit.
    """
    cores = usable_cores()
    if num_proc is not None and num_proc > cores:
        raise DataError(
            f"{option}={num_proc} is more processes than the {cores} CPU core(s) this machine "
            f"gives the run: the limit is {cores} (leave it unset for one per core)"
        )


def typed_columns(config: DataConfig) -> dict[str, str]:
    """Source columns the transform writes with a declared scalar type, and that type."""
    transform = config.transform
    if isinstance(transform, TabularTransform):
        types: dict[str, str] = dict(transform.columns)
    elif isinstance(transform, TextTransform | ChatTransform):
        types = dict(transform.keep_columns)
    else:
        types = {}
    if config.id_column:
        types[config.id_column] = "int64"
    return types


def _int_bounds(dtype: str) -> tuple[int, int]:
    """Smallest and largest value of an integer MDS type ('int8' ... 'uint64')."""
    bits = int(dtype.removeprefix("u").removeprefix("int"))
    if dtype.startswith("u"):
        return 0, 2**bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def _expected(dtype: str) -> str:
    if dtype == "str":
        return "text (str)"
    if dtype == "int64":
        return "an integer (int64)"
    if dtype.startswith(("int", "uint")):
        low, high = _int_bounds(dtype)
        return f"an integer from {low} to {high} ({dtype})"
    return f"a finite number ({dtype})"


def _fits(value: Any, dtype: str) -> bool:
    """Whether one source value, as JSON gives it, can be written as `dtype`."""
    if dtype == "str":
        return isinstance(value, str)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if not math.isfinite(value):
        return False
    if dtype.startswith("float"):
        return True
    if isinstance(value, float) and not value.is_integer():
        return False
    low, high = _int_bounds(dtype)
    return low <= value <= high


def _cell_value(cell: str, dtype: str) -> Any:
    """A CSV cell as the loader reads it: empty is no value, a number in a number column is
    that number."""
    if cell == "":
        return None
    if dtype == "str":
        return cell
    for parse in (int, float):
        try:
            return parse(cell)
        except ValueError:
            continue
    return cell


def _check_values(row: Mapping[str, Any], where: str, types: Mapping[str, str]) -> None:
    for column, dtype in types.items():
        if column in row and not _fits(row[column], dtype):
            value = row[column]
            shown = "an empty value" if value in (None, "") else repr(value)
            raise DataError(
                f"{where}, column {column!r} holds {shown}; expected {_expected(dtype)}"
            )


def check_files(config: DataConfig) -> None:
    """Check local source files before anything is loaded, converted or started.

    Cheap (one pass over JSON rows, the header of a CSV, the schema of a Parquet file), so
    pipelines run it before a Prefect server or any rank starts.

    Raises:
        DataError: naming the file, its split and, for a bad row, the line: an empty file, a
            file with no rows, a row that does not parse, or a column the transform needs
            that the file does not have.
    """
    check_num_proc(config.num_proc)
    source = config.source
    if not isinstance(source, FileSource):
        return
    columns = needed_columns(config)
    types = typed_columns(config)
    for split, paths in source.files.items():
        for path in map(Path, paths):
            if not path.is_file():
                raise DataError(f"file {path} of split {split!r} does not exist")
            if path.stat().st_size == 0:
                raise DataError(f"file {path} of split {split!r} is empty")
            if source.format == "json":
                check_json_rows(path, split, columns, types)
            elif source.format == "csv":
                _check_csv(path, split, columns, types)
            elif source.format == "parquet":
                _check_parquet(path, split, columns, types)


def _missing(where: str, wanted: list[str], has: list[str]) -> DataError:
    missing = [c for c in wanted if c not in has]
    return DataError(f"{where} has no column {missing[0]!r}, which the config reads; it has {has}")


def _check_csv(
    path: Path, split: str, columns: list[str], types: Mapping[str, str] | None = None
) -> None:
    """The header has the columns; with `types`, every row has one cell per header column and
    each typed cell holds a value of its type (line numbers count the header as line 1)."""
    where = f"file {path} of split {split!r}"
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        if not any(cell.strip() for cell in header):
            raise DataError(f"{where} has no header row")
        first = next(reader, None)
        if first is None:
            raise DataError(f"{where} has a header but no rows")
        if set(columns) - set(header):
            raise _missing(where, columns, header)
        cells: list[str] | None = first
        while cells is not None:  # `reader.line_num` is the line the row ends on
            if cells:  # not a blank line
                at = f"{where}: line {reader.line_num}"
                if len(cells) != len(header):
                    raise DataError(
                        f"{at} has {len(cells)} field(s); the header has {len(header)} "
                        f"({', '.join(header)})"
                    )
                row = dict(zip(header, cells, strict=True))
                typed = {c: _cell_value(row[c], t) for c, t in (types or {}).items()}
                _check_values(typed, at, types or {})
            cells = next(reader, None)


def _check_parquet(
    path: Path, split: str, columns: list[str], types: Mapping[str, str] | None = None
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = f"file {path} of split {split!r}"
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as err:  # pyarrow raises ArrowInvalid and friends on a damaged file
        raise DataError(f"{where} is not a readable Parquet file ({err})") from None
    if meta.num_rows == 0:
        raise DataError(f"{where} has no rows")
    schema = meta.schema.to_arrow_schema()
    names = schema.names  # top-level columns, not nested leaves
    if set(columns) - set(names):
        raise _missing(where, columns, names)
    for column, dtype in (types or {}).items():
        kind = schema.field(column).type
        fits = (
            pa.types.is_string(kind) or pa.types.is_large_string(kind)
            if dtype == "str"
            else pa.types.is_integer(kind)
            or (dtype.startswith("float") and pa.types.is_floating(kind))
        )
        if not fits:
            raise DataError(
                f"{where}, column {column!r} holds {kind} values; expected {_expected(dtype)}"
            )
        values = pq.read_table(path, columns=[column]).column(column)
        if values.null_count:
            row = values.is_null().to_numpy(zero_copy_only=False).argmax() + 1
            raise DataError(
                f"{where}: row {row}, column {column!r} holds an empty value; "
                f"expected {_expected(dtype)}"
            )


def check_json_rows(
    path: Path, split: str, columns: Sequence[str] = (), types: Mapping[str, str] | None = None
) -> None:
    """Check a JSON Lines (or one JSON array) file row by row before `datasets` parses it.

    `datasets` reports a bad row without its line ("An error occurred while generating the
    dataset", "position 59"); here the first bad row is named by line and column.

    Raises:
        DataError: a row that is not UTF-8, not JSON or not an object, a row without one of
            `columns`, a row whose value in one of `types`' columns is not of that type, or a
            file with no rows.
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
            _check_values(row, f"{where}: row {number}", types or {})
        return
    with open(path, "rb") as f:  # JSON Lines: one line in memory at a time
        count = _check_lines(f, where, columns, types or {})
    if count == 0:
        raise DataError(f"{where} has no rows: every line is blank")


def _check_lines(
    lines: Iterable[bytes], where: str, columns: Sequence[str], types: Mapping[str, str]
) -> int:
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
        _check_values(row, f"{where}: line {number}", types)
        count += 1
    return count
