"""FSDP2 subflow: parameters, gradients and optimizer state sharded block by block.

For models that do not fit on one GPU. Run the transformer pipeline with it::

    python -m flows.techniques.fsdp         # same as python -m flows.transformer --technique fsdp
"""

import sys

from prefect import flow

from tasks.techniques import train_with_technique
from trainflow.strategies import FSDPConfig
from trainflow.strategies.job import Resources, TrainResult, Workload


@flow(name="fsdp", log_prints=True)
def fsdp(workload: Workload, technique: FSDPConfig, resources: Resources) -> TrainResult:
    """Train `workload` with FSDP2 (`fully_shard` per block, then the root) on `resources`."""
    return train_with_technique(workload, technique, resources)


if __name__ == "__main__":
    from flows.transformer import main

    main(["--technique", "fsdp", *sys.argv[1:]])
