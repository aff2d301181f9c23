"""Simple MLP regression with DDP: train on every rank -> evaluate -> register in MLflow.

Run locally (2 CPU ranks, local Prefect, SQLite MLflow store `mlflow.db`)::

    python -m flows.mlp
    python -m flows.mlp --gpus 8 --gpu-type H100 --num-epochs 20
    python -m flows.mlp --dry-run      # the plan, nothing started
    python -m flows.mlp --help

Deploy: `prefect --no-prompt deploy --name mlp/cpu-local` (see prefect.yaml).
"""

from prefect import flow

from flows import command
from flows.skeleton import PipelineResult, evaluate, finish, register, tracked_run, train
from tasks.plan import plan_run
from trainflow.configs.mlp import MLPConfig
from trainflow.pipelines import PIPELINES

MLP = PIPELINES["mlp"]


@flow(name="mlp", log_prints=True)
def mlp(config: MLPConfig = MLPConfig(), dry_run: bool = False) -> PipelineResult | None:
    """Train the simple MLP with DDP, evaluate on held-out data, register if it learned."""
    if dry_run:
        return plan_run(MLP, config)
    with tracked_run(MLP.ranks, config) as run:
        trained = train(run, config)
        evaluation = evaluate(run, trained)
        registration = register(run, config, evaluation, trained)
    return finish(run, config, trained, evaluation, registration)


def main(argv: list[str] | None = None) -> PipelineResult:
    return command.main("mlp", argv)  # type: ignore[no-any-return]


if __name__ == "__main__":
    command.run("mlp")
