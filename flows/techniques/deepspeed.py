"""DeepSpeed ZeRO subflow: stage 1, 2 or 3, with optional CPU offload.

For advanced memory optimisation. Run the transformer pipeline with it::

    python -m flows.techniques.deepspeed    # = python -m flows.transformer --technique deepspeed
    python -m flows.transformer --technique '{"name": "deepspeed", "zero_stage": 3}'
"""

import sys

from prefect import flow

from tasks.techniques import train_with_technique
from trainflow.strategies import DeepSpeedConfig
from trainflow.strategies.job import Resources, TrainResult, Workload


@flow(name="deepspeed", log_prints=True)
def deepspeed(workload: Workload, technique: DeepSpeedConfig, resources: Resources) -> TrainResult:
    """Train `workload` with DeepSpeed ZeRO on `resources`."""
    return train_with_technique(workload, technique, resources)


if __name__ == "__main__":
    from flows.transformer import main

    main(["--technique", "deepspeed", *sys.argv[1:]])
