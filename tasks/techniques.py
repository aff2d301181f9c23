"""Run a workload with a technique: check it fits, then launch it on every rank."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from trainflow.prefect_adapter import launch_logged
from trainflow.strategies import TechniqueConfig
from trainflow.strategies.job import (
    Resources,
    TrainResult,
    Workload,
    check_before_launch,
    run_on_rank,
)


@task(name="train-with-technique", cache_policy=NO_CACHE, persist_result=False)
def train_with_technique(
    workload: Workload, technique: TechniqueConfig, resources: Resources
) -> TrainResult:
    """Fail before any rank starts if the technique cannot train the workload, else train.

    Not retried here: a rerun resumes only if the workload's `resume_from` points at its
    checkpoints. Returns rank 0's result; rank output goes to this task's logs.
    """
    check_before_launch(workload, technique, resources)
    options = resources.launch_options()
    return launch_logged(run_on_rank, (workload, technique), {}, options).values[0]
