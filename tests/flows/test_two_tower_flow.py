"""`python -m flows.two_tower` end to end: real Prefect server, 2 gloo ranks under our launcher
running the Lightning Trainer, real MDS shards, a temporary MLflow store; and bad input that
fails before launch."""

import json

import mlflow
import pandas as pd
import pytest

from flows import two_tower as pipeline
from trainflow import tracking
from trainflow.paths import run_output_dir, trainflow_home

pytestmark = pytest.mark.slow


def test_pipeline_trains_on_two_lightning_ranks_and_registers_a_recommender(prefect_api):
    name = "two-tower-e2e"
    result = pipeline.main(["--registered-model-name", name, "--training-log-samples"])
    m = result.metrics
    assert m["eval_auroc"] >= m["untrained_auroc"] + 0.2, m
    assert m["eval_recall_at_10"] > m["untrained_recall_at_10"], m
    assert (result.model_version, result.champion, result.alias) == ("1", True, "champion")

    # Lightning ran inside our 2 launched ranks: world size and wrapper seen from the module.
    samples = run_output_dir("two_tower", result.mlflow_run_id) / "samples"
    ranks = {
        int(path.stem.removeprefix("rank_")): [json.loads(line) for line in path.open()]
        for path in samples.glob("rank_*.jsonl")
    }
    assert sorted(ranks) == [0, 1]
    assert {step["world_size"] for lines in ranks.values() for step in lines} == {2}
    # Each rank streamed its own partition: in the first epoch no row was read twice.
    first_epoch = [
        {i for step in lines if step["epoch"] == 0 for i in step["ids"]} for lines in ranks.values()
    ]
    assert first_epoch[0] and first_epoch[1] and not first_epoch[0] & first_epoch[1]
    # Trained only on the past: every training row precedes the held-out ones (split by time).
    trained_ids = {i for lines in ranks.values() for step in lines for i in step["ids"]}
    assert max(trained_ids) < 20000 - 2000 - 1800

    client = tracking.store_client()
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    steps = [h.step for h in client.get_metric_history(run.info.run_id, "train_loss")]
    assert len(steps) > 10 and steps == sorted(steps)  # Lightning's logger, into our run
    assert client.get_metric_history(run.info.run_id, "val_auroc")
    version = client.get_model_version(name, "1")
    assert version.tags["world_size"] == "2" and version.tags["technique"] == "ddp"

    info = mlflow.models.get_model_info(f"models:/{name}@champion")
    assert info.signature is not None and info.saved_input_example_info is not None
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    pairs = pd.DataFrame({"user_id": [3, 3, 17], "item_id": [41, 7, 0]})
    scored = model.predict(pairs)
    assert list(scored.columns) == ["user_id", "item_id", "score"] and len(scored) == 3
    assert scored["score"].between(0, 1).all()
    top = model.predict(pd.DataFrame({"user_id": [3]}), params={"top_k": 10})
    assert len(top) == 10 and set(top["user_id"]) == {3} and top["item_id"].nunique() == 10
    assert top["score"].is_monotonic_decreasing


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--data-user-column", "usr"], "data.user_column='usr'"),
        (["--data-test-fraction", "0.00001"], "data.test_fraction=1e-05"),
        (["--towers-num-items", "50"], "towers.num_items=50"),
        (["--data-time-column", "when"], "data.time_column='when'"),
    ],
    ids=["unknown-column", "empty-split", "ids-past-num-items", "unknown-time-column"],
)
def test_bad_input_fails_before_launch_naming_the_field(args, field, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main([*args, "--registered-model-name", "two-tower-bad"])
    assert exit_info.value.code == 2
    assert field in capsys.readouterr().err
    client = tracking.store_client()
    assert client.get_experiment_by_name("two_tower") is None
    assert not (trainflow_home() / "runs").exists()


def test_zero_users_is_refused_by_the_command_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main(["--towers-num-users", "0"])
    assert exit_info.value.code == 2
    assert "--towers-num-users" in capsys.readouterr().err
    assert not (trainflow_home() / "runs").exists()
