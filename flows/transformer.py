"""Sequence classification with a ~10M-parameter transformer: train -> evaluate -> register.

FSDP2 by default; `--technique` switches to ddp or deepspeed (or takes a JSON object with the
technique's options). Run locally (2 CPU ranks, local Prefect, SQLite MLflow store)::

    python -m flows.transformer
    python -m flows.transformer --technique '{"name": "deepspeed", "zero_stage": 3}'
    python -m flows.transformer --gpus 8 --gpu-type H100 --training-num-steps 1000
    python -m flows.transformer --help

Deploy: `prefect --no-prompt deploy --name transformer/cpu-local` (see prefect.yaml).
"""

import sys

from prefect import flow

from flows.skeleton import PipelineResult, evaluate, finish, register, tracked_run, train
from trainflow.cli import preload, run_pipeline
from trainflow.configs.transformer import TransformerConfig
from trainflow.workloads import WORKLOADS

TRANSFORMER = WORKLOADS["transformer"]


@flow(name="transformer", log_prints=True)
def transformer(config: TransformerConfig = TransformerConfig()) -> PipelineResult:
    """Train the transformer with the chosen technique, evaluate it, register it if it learned."""
    with tracked_run(TRANSFORMER, config) as run:
        trained = train(run, config)
        evaluation = evaluate(run, trained)
        registration = register(run, config, evaluation, trained)
    return finish(run, config, trained, evaluation, registration)


def main(argv: list[str] | None = None) -> PipelineResult:
    from flows.local_server import starting_prefect_server

    return run_pipeline(
        transformer,
        TransformerConfig(),
        argv,
        __doc__,
        server=starting_prefect_server,
        deep_check=preload(
            "trainflow.workloads.transformer",
            "mlflow",
            launch_module="trainflow.workloads.transformer",
        ),
    )


if __name__ == "__main__":
    from trainflow.cli import exit_now

    main(sys.argv[1:])
    exit_now()  # the pipeline is done: skip only the interpreter's teardown
