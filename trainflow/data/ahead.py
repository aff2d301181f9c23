"""Datasets being prepared ahead, elsewhere: by a launch's standby agent, which imports
`datasets`, `streaming` and the tokenizer for its ranks anyway.

A pipeline that has its launch agent prepare the dataset (`offer`) lets the prepare task wait
for that instead of importing the data stack and building the same shards itself (`take`).
The agent's outcome is the one `trainflow.launch.agent.run_calls` writes: the published dataset,
the message of the `DataError` that refused the input, or a failure, after which the task
builds the dataset itself.

This module imports nothing heavy: it is read in the pipeline's process.
"""

import threading
from collections.abc import Callable
from typing import Any

from trainflow.data.config import DataConfig, PreparedDataset
from trainflow.data.errors import DataError

Outcome = Callable[[], dict[str, Any] | None]

_offered: dict[str, Outcome] = {}
_lock = threading.Lock()


def prepare_call(config: DataConfig) -> tuple[str, Any]:
    """The call a launch's standby agent runs to prepare `config`'s dataset
    (`trainflow.launch.backends.standby(then=...)`)."""
    return ("trainflow.data.prepare:prepare_ahead", config.model_dump(mode="json"))


def offer(config: DataConfig, outcome: Outcome) -> None:
    """`outcome()` waits for `config`'s dataset, prepared elsewhere, and returns its outcome
    (None: nothing was prepared there)."""
    with _lock:
        _offered[config.model_dump_json()] = outcome


def take(config: DataConfig, fingerprint: str) -> PreparedDataset | None:
    """`config`'s dataset as prepared elsewhere, waited for; None if none was offered, or the
    preparation there failed or made another dataset (the caller builds it). An offer is
    taken once: a retry builds it here.

    Raises:
        DataError: the preparation refused the input (the message names the file or field).
    """
    with _lock:
        outcome = _offered.pop(config.model_dump_json(), None)
    found = outcome() if outcome is not None else None
    if found is None:
        return None
    if "refused" in found:
        raise DataError(found["refused"])
    if "value" not in found:
        return None
    prepared = PreparedDataset.model_validate(found["value"])
    return prepared if prepared.fingerprint == fingerprint else None
