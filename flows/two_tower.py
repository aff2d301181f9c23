"""Two-tower recommender with Lightning: prepare -> train -> evaluate -> register.

The `debug_cpu` preset (default) trains on the shipped user-item interactions with DDP on 2
CPU ranks in about a minute. Run locally (local Prefect, SQLite MLflow store `mlflow.db`)::

    python -m flows.two_tower
    python -m flows.two_tower --technique fsdp --training-num-epochs 4
    python -m flows.two_tower --preset gpu         # FSDP2 on 8 H100s, wider towers
    python -m flows.two_tower --dry-run            # the plan, nothing started
    python -m flows.two_tower --help

Deploy: `prefect --no-prompt deploy --name two_tower/cpu-local` (see prefect.yaml).
"""

from prefect import flow

from flows import command
from flows.skeleton import DatasetResult, evaluate, finish, preflight, register, tracked_run, train
from tasks.data import prepare_dataset
from tasks.plan import plan_run
from trainflow.configs.two_tower import TwoTowerConfig, TwoTowerJob
from trainflow.pipelines import PIPELINES

TWO_TOWER = PIPELINES["two_tower"]


@flow(name="two_tower", log_prints=True)
def two_tower(
    config: TwoTowerConfig = TWO_TOWER.defaults(), dry_run: bool = False
) -> DatasetResult | None:
    """Train a two-tower recommender: prepare -> train -> evaluate -> register (alias past
    the gate)."""
    if dry_run:
        return plan_run(TWO_TOWER, config)
    preflight(TWO_TOWER.ranks, config)  # before the data is prepared
    data = prepare_dataset(config.data_config())
    categories = TWO_TOWER.ranks.load().item_categories(config, data)
    job = TwoTowerJob(config=config, data=data, item_categories=categories)
    lineage = {"dataset_uri": data.uri, "dataset_fingerprint": data.fingerprint}
    with tracked_run(TWO_TOWER.ranks, config, lineage, job=job, checked=True) as run:
        trained = train(run, config)
        evaluation = evaluate(run, trained)
        registration = register(run, config, evaluation, trained)
    return finish(
        run, config, trained, evaluation, registration, DatasetResult, dataset_uri=data.uri
    )


def main(argv: list[str] | None = None) -> DatasetResult:
    return command.main("two_tower", argv)  # type: ignore[no-any-return]


if __name__ == "__main__":
    command.run("two_tower")
