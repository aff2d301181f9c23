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


def test_a_framework_pipeline_sweep_runs_llm_foundry_trials_nested_under_the_sweep(prefect_api):
    from trainflow.configs.frameworks import FRAMEWORKS

    python = FRAMEWORKS["llm-foundry"].default_python()
    if not python.exists():
        pytest.skip(f"{python} missing: `bash scripts/setup-framework.sh llm-foundry` makes it")
    config = SweepConfig(
        pipeline="llm_foundry",
        space={"max_steps": [4, 8]},
        base={
            "evaluation": {"num_samples": 16, "max_new_tokens": 4},
            "retries": 0,
            "registered_model_name": "llm-foundry-sweep",
        },
        sampler="grid",
        trials=2,
        budget=2,
        pool="llm-foundry-sweep-ranks",
    )
    assert (config.metric, config.mode) == ("eval_loss", "min")
    result = sweep(config)

    assert (result.num_complete, result.num_failed) == (2, 0)
    children = _children(result.mlflow_run_id)
    assert sorted(c.data.metrics["steps"] for c in children) == [4.0, 8.0]
    assert {c.info.status for c in children} == {"FINISHED"}
    assert {c.data.tags["framework"] for c in children} == {"llm-foundry"}
    losses = [c.data.metrics["eval_loss"] for c in children]
    assert result.metrics["best_eval_loss"] == pytest.approx(min(losses))
