"""Two-tower recommender with Lightning: prepare -> train -> evaluate -> register.

The `debug_cpu` preset (default) trains on the shipped user-item interactions with DDP on 2
CPU ranks in about a minute. Run locally (local Prefect, SQLite MLflow store `mlflow.db`)::

    python -m flows.two_tower
    python -m flows.two_tower --technique fsdp --training-num-epochs 4
    python -m flows.two_tower --preset gpu         # FSDP2 on 8 H100s, wider towers
    python -m flows.two_tower --help

Deploy: `prefect --no-prompt deploy --name two_tower/cpu-local` (see prefect.yaml).
"""

import functools
import sys

from prefect import flow

from flows.skeleton import (
    DatasetResult,
    evaluate,
    finish,
    preflight,
    register,
    tracked_run,
    train,
)
from tasks.data import prepare_dataset
from trainflow.cli import run_pipeline, start_launch_agent
from trainflow.configs.two_tower import (
    TwoTowerConfig,
    TwoTowerJob,
    load_two_tower_preset,
    two_tower_preset_names,
)
from trainflow.workloads import WORKLOADS

TWO_TOWER = WORKLOADS["two_tower"]


@flow(name="two_tower", log_prints=True)
def two_tower(config: TwoTowerConfig = load_two_tower_preset("debug_cpu")) -> DatasetResult:
    """Train a two-tower recommender: prepare -> train -> evaluate -> register (alias past
    the gate)."""
    preflight(TWO_TOWER, config)  # before the data is prepared
    data = prepare_dataset(config.data_config())
    categories = TWO_TOWER.load().item_categories(config, data)
    job = TwoTowerJob(config=config, data=data, item_categories=categories)
    lineage = {"dataset_uri": data.uri, "dataset_fingerprint": data.fingerprint}
    with tracked_run(TWO_TOWER, config, lineage, job=job, checked=True) as run:
        trained = train(run, config)
        evaluation = evaluate(run, trained)
        registration = register(run, config, evaluation, trained)
    return finish(
        run, config, trained, evaluation, registration, DatasetResult, dataset_uri=data.uri
    )


SUMMARY_METRICS = [
    f"{when}_{name}" for name in ("auroc", "recall_at_10") for when in ("untrained", "eval")
] + ["train_best_val_auroc"]

PRESETS = {
    name: functools.partial(load_two_tower_preset, name) for name in two_tower_preset_names()
}


def main(argv: list[str] | None = None) -> DatasetResult:
    from flows.local_server import starting_prefect_server

    return run_pipeline(  # type: ignore[no-any-return]
        two_tower,
        load_two_tower_preset("debug_cpu"),
        argv,
        __doc__,
        PRESETS,
        SUMMARY_METRICS,
        server=starting_prefect_server,
        deep_check=_check_config,
    )


def _check_config(config: TwoTowerConfig) -> None:
    start_launch_agent(config, "trainflow.workloads.two_tower")  # its imports run beside these
    from trainflow.workloads.two_tower import check_config

    check_config(config)


if __name__ == "__main__":
    from trainflow.cli import exit_now

    main(sys.argv[1:])
    exit_now()  # the pipeline is done: skip only the interpreter's teardown
