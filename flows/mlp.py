"""Simple MLP regression with DDP: train on every rank -> evaluate -> register in MLflow.

Run locally (2 CPU ranks, local Prefect, SQLite MLflow store `mlflow.db`)::

    python -m flows.mlp
    python -m flows.mlp --gpus 8 --gpu-type H100 --num-epochs 20
    python -m flows.mlp --help

Deploy: `prefect --no-prompt deploy --name mlp/cpu-local` (see prefect.yaml).
"""

import sys

from prefect import flow

from flows.skeleton import PipelineResult, evaluate, finish, register, tracked_run, train
from trainflow.cli import preload, run_pipeline
from trainflow.configs.mlp import MLPConfig
from trainflow.workloads import WORKLOADS

MLP = WORKLOADS["mlp"]


@flow(name="mlp", log_prints=True)
def mlp(config: MLPConfig = MLPConfig()) -> PipelineResult:
    """Train the simple MLP with DDP, evaluate on held-out data, register if it learned."""
    with tracked_run(MLP, config) as run:
        trained = train(run, config)
        evaluation = evaluate(run, trained)
        registration = register(run, config, evaluation, trained)
    return finish(run, config, trained, evaluation, registration)


def main(argv: list[str] | None = None) -> PipelineResult:
    from flows.local_server import starting_prefect_server

    return run_pipeline(
        mlp,
        MLPConfig(),
        argv,
        __doc__,
        server=starting_prefect_server,
        deep_check=preload(
            "trainflow.workloads.mlp", "mlflow", launch_module="trainflow.workloads.mlp"
        ),
    )


if __name__ == "__main__":
    from trainflow.cli import exit_now

    main(sys.argv[1:])
    exit_now()  # the pipeline is done: skip only the interpreter's teardown
