"""Evaluate trained weights on held-out data."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from trainflow.workloads import mlp


@task(name="evaluate-mlp", cache_policy=NO_CACHE)
def evaluate_mlp(config: mlp.MLPConfig, model_path: str) -> dict[str, float]:
    """Held-out MSE and R^2 of the weights at `model_path`."""
    return mlp.evaluate(config, mlp.load_model(config, model_path))
