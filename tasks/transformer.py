"""Evaluate the transformer's exported weights on held-out data."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from trainflow.strategies.job import local_path
from trainflow.workloads import transformer


@task(name="evaluate-transformer", cache_policy=NO_CACHE)
def evaluate_transformer(config: transformer.TransformerConfig, model_uri: str) -> dict[str, float]:
    """Held-out loss and accuracy of the consolidated weights at `model_uri`."""
    return transformer.evaluate(config, transformer.load_model(config, local_path(model_uri)))
