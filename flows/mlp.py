"""Simple MLP regression with DDP: train on every rank -> evaluate -> register in MLflow.

Run locally (2 CPU ranks, local Prefect, SQLite MLflow store `mlflow.db`)::

    python -m flows.mlp
    python -m flows.mlp --gpus 8 --gpu-type H100 --num-epochs 20
    python -m flows.mlp --help

Deploy: `prefect --no-prompt deploy --name mlp/cpu-local` (see prefect.yaml).
"""

import sys
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from tasks.evaluation import evaluate_mlp
from tasks.reporting import publish_summary
from tasks.tracking import log_metrics, register_pytorch_model
from tasks.training import launch_training
from trainflow import LaunchOptions
from trainflow.cli import parse_config, print_summary
from trainflow.paths import trainflow_home
from trainflow.tracking import pipeline_run, tracking_uri
from trainflow.workloads import mlp as workload


class MLPResult(BaseModel):
    """What a pipeline run produced."""

    mlflow_run_id: str = Field(description="MLflow run holding params, metrics and the model.")
    model_version: str | None = Field(description="Registered version; None if the gate failed.")
    registered_model_name: str = Field(description="MLflow registered model name.")
    metrics: dict[str, float] = Field(description="Final training and held-out metrics.")
    tracking_uri: str = Field(description="MLflow store the run was logged to.")


@flow(name="mlp", log_prints=True)
def mlp(config: workload.MLPConfig = workload.MLPConfig()) -> MLPResult:
    """Train the simple MLP with DDP, evaluate on held-out data, register if it learned."""
    with pipeline_run(
        config.experiment_name,
        run_name=f"mlp-{flow_run.get_name() or 'local'}",
        params=config.model_dump(),
        tags={"prefect.flow_run_id": str(flow_run.get_id()), "technique": "ddp"},
    ) as run_id:
        output_dir = str(trainflow_home() / "outputs" / "mlp" / run_id)
        options = LaunchOptions(
            gpus=config.gpus, gpu_type=config.gpu_type, timeout=config.timeout_s
        )
        ranks = launch_training(workload.train, (config, output_dir, run_id), options)
        model_path = str(Path(output_dir) / "model.pt")
        metrics = {"train_loss": ranks[0]["final_loss"], "steps": float(ranks[0]["steps"])}
        metrics |= evaluate_mlp(config, model_path)
        log_metrics(run_id, metrics)
        version = None
        if metrics["eval_r2"] >= config.min_r2:
            x, _ = workload.make_regression(4, config.num_features, 0, 0.0)
            version = register_pytorch_model(
                run_id,
                workload.load_model(config, model_path),
                config.registered_model_name,
                x.numpy(),
                {
                    "technique": "ddp",
                    "world_size": str(config.gpus),
                    "mlflow_run_id": run_id,
                    "prefect_flow_run_id": str(flow_run.get_id()),
                },
            )
        else:
            print(f"eval_r2={metrics['eval_r2']:.3f} < min_r2={config.min_r2}: not registered")
    publish_summary(
        "mlp-summary",
        title="MLP pipeline",
        config=config.model_dump(),
        metrics=metrics,
        model=f"{config.registered_model_name} v{version}" if version else "not registered",
        mlflow_run_id=run_id,
    )
    return MLPResult(
        mlflow_run_id=run_id,
        model_version=version,
        registered_model_name=config.registered_model_name,
        metrics=metrics,
        tracking_uri=tracking_uri(),
    )


def main(argv: list[str] | None = None) -> MLPResult:
    config = parse_config(
        workload.MLPConfig,
        workload.MLPConfig(),
        argv,
        prog="python -m flows.mlp",
        description=__doc__ or "",
    )
    result = mlp(config)
    print_summary(
        "mlp pipeline finished",
        {
            "MLflow store": result.tracking_uri,
            "MLflow run": result.mlflow_run_id,
            "Model": f"{result.registered_model_name} version "
            + (result.model_version or "not registered (gate failed)"),
        },
        result.metrics,
    )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
