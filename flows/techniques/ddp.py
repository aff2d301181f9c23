"""DDP subflow: a full model replica per rank, gradients all-reduced in buckets.

For models that fit on one GPU. Run the transformer pipeline with it::

    python -m flows.techniques.ddp          # same as python -m flows.transformer --technique ddp
"""

import sys

from prefect import flow

from tasks.techniques import train_with_technique
from trainflow.strategies import DDPConfig
from trainflow.strategies.job import Resources, TrainResult, Workload


@flow(name="ddp", log_prints=True)
def ddp(workload: Workload, technique: DDPConfig, resources: Resources) -> TrainResult:
    """Train `workload` with DistributedDataParallel on `resources`."""
    return train_with_technique(workload, technique, resources)


if __name__ == "__main__":
    from flows.transformer import main

    main(["--technique", "ddp", *sys.argv[1:]])
