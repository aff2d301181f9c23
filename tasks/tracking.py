"""Evaluation logging and model registration against the MLflow store."""

from collections.abc import Mapping
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from trainflow import tracking


@task(name="log-metrics", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def log_metrics(run_id: str, metrics: Mapping[str, float]) -> None:
    """Record final metrics on the pipeline's run (idempotent, so retried)."""
    tracking.log_metrics(run_id, metrics)


@task(name="register-model", cache_policy=NO_CACHE)
def register_pytorch_model(
    run_id: str,
    model: Any,
    registered_model_name: str,
    input_example: Any,
    tags: Mapping[str, str],
) -> str:
    """Log the model to the run and add a registry version; returns the version."""
    return tracking.register_pytorch_model(
        run_id, model, registered_model_name, input_example, tags
    )
