"""The two-tower pipeline's checks, kept apart from the training code: they load no Lightning
or torch, so they run in a second before the server starts, and in `--dry-run`."""

from typing import Any

import numpy as np

from trainflow.configs.two_tower import TwoTowerConfig
from trainflow.data import DataError
from trainflow.data.checks import check_files
from trainflow.data.sources import holdout_size, load_source


def check_config(config: TwoTowerConfig) -> None:
    """Refuse, before data is prepared or any rank starts, input the ranks would fail on.

    Every named column exists, every split keeps rows after the split by time, and every id
    fits its tower (an id past `num_users` would fail inside an embedding, on a rank).

    Raises:
        ValueError: naming the config field, the bad value and what the data holds.
    """
    data = config.data_config()
    try:
        check_files(data)
    except DataError as err:
        for field, column in config.data.columns().items():
            if f"column {column!r}" not in str(err):
                continue
            try:
                check_files(_reading_only(data, column))
            except DataError:
                raise ValueError(f"data.{field}={column!r}: {err}") from None
        raise ValueError(f"data.dataset={config.data.dataset!r}: {err}") from None
    rows = load_source(data.model_copy(update={"test": None, "validation": None}))["train"]
    d = config.data
    if d.time_column not in rows.column_names:
        raise ValueError(
            f"data.time_column={d.time_column!r} is not a column of {d.dataset!r}; "
            f"it has {rows.column_names}"
        )
    num_test = holdout_size(len(rows), d.test_fraction)
    num_validation = holdout_size(len(rows) - num_test, d.validation_fraction)
    for field, size in (("test_fraction", num_test), ("validation_fraction", num_validation)):
        if size == 0:
            raise ValueError(
                f"data.{field}={getattr(d, field)} leaves the {field.removesuffix('_fraction')} "
                f"split empty: {d.dataset!r} has {len(rows)} rows"
            )
    num_train = len(rows) - num_test - num_validation
    if num_train == 0:
        raise ValueError(f"data: the train split of {d.dataset!r} would be empty")
    if config.training.batch_size * config.gpus > num_train:
        raise ValueError(
            f"training.batch_size={config.training.batch_size} x gpus={config.gpus} exceeds "
            f"the train split of {d.dataset!r} ({num_train} rows): no full step fits"
        )
    t = config.towers
    for column, field, bound in (
        (d.user_column, "num_users", t.num_users),
        (d.item_column, "num_items", t.num_items),
        (d.category_column, "num_categories", t.num_categories),
    ):
        values = np.asarray(rows[column])
        if values.min() < 0 or values.max() >= bound:
            raise ValueError(
                f"towers.{field}={bound}: column {column!r} holds ids "
                f"{values.min()}..{values.max()}; ids must be 0..{bound - 1}"
            )
    labels = set(np.unique(np.asarray(rows[d.label_column])).tolist())
    if not labels <= {0, 1}:
        raise ValueError(f"data.label_column={d.label_column!r} holds {sorted(labels)}, not 0/1")


def _reading_only(data: Any, column: str) -> Any:
    """`data` with a transform that reads just `column` (to tell which column is missing or
    holds a bad value)."""
    transform = data.transform.model_copy(
        update={"columns": {column: data.transform.columns[column]}}
    )
    return data.model_copy(update={"transform": transform})
