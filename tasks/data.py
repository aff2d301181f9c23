"""Prefect task: prepare a dataset as MDS shards, cached by content.

The cache key is the dataset's URI, which already encodes the source's content, the
tokenizer's content and every option (`trainflow.data.dataset_uri`); results are persisted, so
a re-run anywhere that shares the result store is a `Cached` state that does no work. If the
published dataset was deleted or damaged since, the record is refreshed instead of returned.

The content fingerprint reads every source and tokenizer file, so `prepare_dataset` computes it
once and hands it to the lookup, the cache key and the build. `trainflow.data.prepare` (which
imports `datasets` and torch) is imported when the task runs, not when a flow module is. A
pipeline whose launch agent prepares the dataset ahead (`trainflow.data.ahead`) has the task
wait for it instead.
"""

import hashlib
from typing import Any

from prefect import Task, get_run_logger, task
from prefect.cache_policies import CacheKeyFnPolicy
from prefect.client.schemas.objects import TaskRun
from prefect.context import TaskRunContext
from prefect.states import State

from trainflow.data import DataConfig, DataError, PreparedDataset, ahead


def _dataset_key(_: TaskRunContext, parameters: dict[str, Any]) -> str:
    from trainflow.data.prepare import dataset_uri

    uri = dataset_uri(parameters["config"], parameters.get("fingerprint"))
    return "trainflow-dataset-" + hashlib.sha256(uri.encode()).hexdigest()


def _retry_unless_bad_input(_task: Task, _run: TaskRun, state: State) -> bool:
    """Retry I/O failures (the build is idempotent), never bad input."""
    try:
        state.result()
    except DataError:
        return False
    except Exception:
        return True
    return False


@task(
    name="prepare-dataset",
    cache_policy=CacheKeyFnPolicy(cache_key_fn=_dataset_key),
    persist_result=True,
    retries=1,
    retry_condition_fn=_retry_unless_bad_input,
    # `datasets` hashes the functions it maps with dill, which finds their globals by
    # disassembling them into a captured stdout; a run's print-to-log would take that output
    # (the bytecode showed in the run's log) and leave dill with nothing to read.
    log_prints=False,
)
def _prepare_dataset(config: DataConfig, fingerprint: str | None = None) -> PreparedDataset:
    logger = get_run_logger()
    result = ahead.take(config, fingerprint) if fingerprint is not None else None
    if result is not None:
        logger.info(
            "%s %s in the launch's agent: %s",
            "found" if result.cache_hit else "built",
            result.uri,
            {s: i.num_samples for s, i in result.splits.items()},
        )
        return result

    from trainflow.data.prepare import prepare_dataset as build_dataset

    result = build_dataset(config, fingerprint)
    if result.cache_hit:
        logger.info("cache hit: %s was already published; nothing to do", result.uri)
    else:
        logger.info(
            "built %s: %s", result.uri, {s: i.num_samples for s, i in result.splits.items()}
        )
    return result


def prepare_dataset(config: DataConfig) -> PreparedDataset:
    """Prepare `config`'s dataset through the cached task (call inside a flow).

    Args:
        config: What to prepare.

    Returns:
        The published dataset (URI, per-split counts, columns, bytes).
    """
    from trainflow.data.prepare import dataset_fingerprint, find_published

    fingerprint = dataset_fingerprint(config)
    published = find_published(config, fingerprint)
    state = _prepare_dataset.with_options(refresh_cache=published is None)(
        config, fingerprint, return_state=True
    )
    result = state.result()
    if state.name == "Cached":
        get_run_logger().info("cache hit: reusing %s from the Prefect cache", result.uri)
        result = result.model_copy(update={"cache_hit": True})
    return result
