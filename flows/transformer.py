"""Sequence classification with a ~10M-parameter transformer: train -> evaluate -> register.

FSDP2 by default; `--technique` switches to ddp or deepspeed (or takes a JSON object with the
technique's options). Run locally (2 CPU ranks, local Prefect, SQLite MLflow store
`mlflow.db`)::

    python -m flows.transformer
    python -m flows.transformer --technique ddp --training-num-steps 100
    python -m flows.transformer --technique '{"name": "deepspeed", "zero_stage": 3}'
    python -m flows.transformer --help

Deploy: `prefect --no-prompt deploy --name transformer/cpu-local` (see prefect.yaml).
"""

import sys

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from flows.techniques import techniques
from tasks.tracking import log_metrics, register_pytorch_model
from tasks.transformer import evaluate_transformer
from trainflow.cli import parse_config, print_summary
from trainflow.paths import trainflow_home
from trainflow.strategies.job import Workload, local_path
from trainflow.tracking import pipeline_run, tracking_uri
from trainflow.workloads import transformer as workload


class TransformerResult(BaseModel):
    """What a pipeline run produced."""

    mlflow_run_id: str = Field(description="MLflow run holding params, metrics and the model.")
    technique: str = Field(description="Technique that trained the model.")
    model_version: str | None = Field(description="Registered version; None if the gate failed.")
    registered_model_name: str = Field(description="MLflow registered model name.")
    checkpoint_uri: str | None = Field(description="Last training checkpoint.")
    metrics: dict[str, float] = Field(description="Final training and held-out metrics.")
    tracking_uri: str = Field(description="MLflow store the run was logged to.")


@flow(name="transformer", log_prints=True)
def transformer(
    config: workload.TransformerConfig = workload.TransformerConfig(),
) -> TransformerResult:
    """Train the transformer with the chosen technique, evaluate it, register it if it learned."""
    technique = config.technique.name
    with pipeline_run(
        config.experiment_name,
        run_name=f"transformer-{technique}-{flow_run.get_name() or 'local'}",
        params=config.model_dump(),
        tags={"prefect.flow_run_id": str(flow_run.get_id()), "technique": technique},
    ) as run_id:
        trained = techniques[technique](
            workload=Workload(
                train_fn=workload.train,
                model_fn=workload.build_model,
                config=config,
                output_dir=str(trainflow_home() / "outputs" / "transformer" / run_id),
                mlflow_run_id=run_id,
            ),
            technique=config.technique,
            resources=config.resources,
        )
        report = evaluate_transformer(config, trained.model_uri)
        log_metrics(run_id, report)
        metrics = {f"train_{k}": v for k, v in trained.metrics.items()} | report
        version = None
        if report["eval_accuracy"] >= config.min_eval_accuracy:
            tokens, _ = workload.make_samples(config, 2, seed=0)
            version = register_pytorch_model(
                run_id,
                workload.load_model(config, local_path(trained.model_uri)),
                config.registered_model_name,
                tokens.numpy(),
                {
                    "technique": technique,
                    "world_size": str(trained.world_size),
                    "mlflow_run_id": run_id,
                    "prefect_flow_run_id": str(flow_run.get_id()),
                    "checkpoint_uri": trained.checkpoint_uri or "",
                },
            )
        else:
            print(
                f"eval_accuracy={report['eval_accuracy']:.3f} < "
                f"min_eval_accuracy={config.min_eval_accuracy}: not registered"
            )
    return TransformerResult(
        mlflow_run_id=run_id,
        technique=technique,
        model_version=version,
        registered_model_name=config.registered_model_name,
        checkpoint_uri=trained.checkpoint_uri,
        metrics=metrics,
        tracking_uri=tracking_uri(),
    )


def main(argv: list[str] | None = None) -> TransformerResult:
    config = parse_config(
        workload.TransformerConfig,
        workload.TransformerConfig(),
        argv,
        prog="python -m flows.transformer",
        description=__doc__ or "",
    )
    result = transformer(config)
    print_summary(
        "transformer pipeline finished",
        {
            "MLflow store": result.tracking_uri,
            "MLflow run": result.mlflow_run_id,
            "Technique": result.technique,
            "Model": f"{result.registered_model_name} version "
            + (result.model_version or "not registered (gate failed)"),
        },
        result.metrics,
    )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
