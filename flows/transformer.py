"""Sequence classification with a ~10M-parameter transformer: train -> evaluate -> register.

FSDP2 by default; `--technique` switches to ddp or deepspeed (or takes a JSON object with the
technique's options). Run locally (2 CPU ranks, local Prefect, SQLite MLflow store)::

    python -m flows.transformer
    python -m flows.transformer --technique '{"name": "deepspeed", "zero_stage": 3}'
    python -m flows.transformer --gpus 8 --gpu-type H100 --training-num-steps 1000
    python -m flows.transformer --dry-run      # the plan, nothing started
    python -m flows.transformer --help

Deploy: `prefect --no-prompt deploy --name transformer/cpu-local` (see prefect.yaml).
"""

from prefect import flow

from flows import command
from flows.skeleton import PipelineResult, evaluate, finish, register, tracked_run, train
from tasks.plan import plan_run
from trainflow.configs.transformer import TransformerConfig
from trainflow.pipelines import PIPELINES

TRANSFORMER = PIPELINES["transformer"]


@flow(name="transformer", log_prints=True)
def transformer(
    config: TransformerConfig = TransformerConfig(), dry_run: bool = False
) -> PipelineResult | None:
    """Train the transformer with the chosen technique, evaluate it, register it if it learned."""
    if dry_run:
        return plan_run(TRANSFORMER, config)
    with tracked_run(TRANSFORMER.ranks, config) as run:
        trained = train(run, config)
        evaluation = evaluate(run, trained)
        registration = register(run, config, evaluation, trained)
    return finish(run, config, trained, evaluation, registration)


def main(argv: list[str] | None = None) -> PipelineResult:
    return command.main("transformer", argv)  # type: ignore[no-any-return]


if __name__ == "__main__":
    command.run("transformer")
