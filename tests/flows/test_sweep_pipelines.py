"""Sweeps of the pipelines beyond the MLP: each trial is that pipeline's own flow run, nested
under the sweep's MLflow run, toward the pipeline's own metric. Real Prefect server and
concurrency limit, 2-rank gloo trials, real MDS shards, a SQLite MLflow store."""

import pytest

from flows.sweep import SweepConfig, sweep
from trainflow import tracking

pytestmark = pytest.mark.slow


def _children(parent: str) -> list:
    client = tracking.store_client()
    experiment = client.get_run(parent).info.experiment_id
    return client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent}'")


def test_a_two_tower_sweep_runs_lightning_trials_and_promotes_the_best_by_auroc(prefect_api):
    config = SweepConfig(
        pipeline="two_tower",
        space={"training.optimizer.learning_rate": [0.001, 0.03]},
        base={
            "training": {"num_epochs": 3},
            "checkpoint_every": 0,
            "retries": 0,
            "registered_model_name": "two-tower-sweep",
        },
        sampler="grid",
        trials=2,
        budget=2,
        pool="two-tower-sweep-ranks",
    )
    assert (config.metric, config.mode) == ("eval_auroc", "max")  # the pipeline's own
    result = sweep(config)

    assert (result.num_complete, result.num_failed) == (2, 0)
    children = _children(result.mlflow_run_id)
    assert len(children) == 2
    assert {c.info.status for c in children} == {"FINISHED"}
    aurocs = [c.data.metrics["eval_auroc"] for c in children]
    assert result.metrics["best_eval_auroc"] == pytest.approx(max(aurocs))
    # Trials never move the alias themselves; the sweep gives it to the best, past its gate.
    client = tracking.store_client()
    if result.champion:
        version = client.get_model_version_by_alias("two-tower-sweep", "champion")
        assert version.version == result.model_version
