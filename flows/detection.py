"""Object detection with RetinaNet under DDP: generate -> prepare -> train -> evaluate -> register.

The `debug_cpu` preset (default) draws 64 px images of three kinds of shapes, prepares them as
MDS shards and trains a RetinaNet on a tiny backbone with DDP on 2 CPU ranks in about a
minute. The held-out mAP of the trained model is compared with the untrained one's; the model
is registered only when its mAP reaches `evaluation.min_map`. Run locally (local Prefect,
SQLite MLflow store `mlflow.db`)::

    python -m flows.detection
    python -m flows.detection --training-num-steps 400 --data-num-classes 4
    python -m flows.detection --preset gpu         # 256 px, 8 classes, ResNet-50, 8 GPUs
    python -m flows.detection --dry-run     # the plan, nothing started
    python -m flows.detection --help

Deploy: `prefect --no-prompt deploy --name detection/cpu-local` (see prefect.yaml).
"""

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows import command
from flows.skeleton import (
    DatasetResult,
    TrackedRun,
    evaluate,
    finish,
    preflight,
    register,
    tracked_run,
    train,
)
from tasks.data import prepare_dataset
from tasks.plan import plan_run
from tasks.reporting import figure_markdown
from trainflow import tracking
from trainflow.configs.detection import DetectionConfig, DetectionJob, ShapesData
from trainflow.pipelines import PIPELINES
from trainflow.workloads import Evaluation

DETECTION = PIPELINES["detection"]
PLOT_FILE = "predictions.png"


@task(name="generate-shapes", cache_policy=NO_CACHE)
def generate_shapes(data: ShapesData) -> dict[str, str]:
    """Draw the dataset's images once per spec; returns split -> Parquet file."""
    from trainflow.data.shapes import generated_files

    return generated_files(data.spec(), data.counts())


@task(name="publish-predictions", cache_policy=NO_CACHE)
def publish_predictions(run: TrackedRun, evaluation: Evaluation) -> str:
    """Plot the trained model's boxes on held-out images, in MLflow and as a Prefect artifact."""
    figure = run.workload.load().predictions_figure(run.job, evaluation.model)
    tracking.log_figure(run.run_id, figure, PLOT_FILE)
    return str(
        create_markdown_artifact(
            key=f"{run.name}-predictions",
            markdown=f"# {run.name}: held-out predictions\n\n"
            f"{figure_markdown(figure, 'predictions')}\n",
            description="Predicted boxes on held-out images",
        )
    )


@flow(name="detection", log_prints=True)
def detection(
    config: DetectionConfig = DETECTION.defaults(), dry_run: bool = False
) -> DatasetResult | None:
    """Train RetinaNet with DDP on generated shapes, compare held-out mAP with the untrained
    model's, plot its boxes, register it if it passes the gate."""
    if dry_run:
        return plan_run(DETECTION, config)
    preflight(DETECTION.ranks, config)  # before the images are drawn and prepared
    data = prepare_dataset(config.data_config(generate_shapes(config.data)))
    lineage = {"dataset_uri": data.uri, "dataset_fingerprint": data.fingerprint}
    job = DetectionJob(config=config, data=data)
    with tracked_run(DETECTION.ranks, config, lineage, job=job, checked=True) as run:
        trained = train(run, config)
        evaluation = evaluate(run, trained)
        publish_predictions(run, evaluation)
        registration = register(run, config, evaluation, trained)
    return finish(
        run, config, trained, evaluation, registration, DatasetResult, dataset_uri=data.uri
    )


def main(argv: list[str] | None = None) -> DatasetResult:
    return command.main("detection", argv)  # type: ignore[no-any-return]


if __name__ == "__main__":
    command.run("detection")
