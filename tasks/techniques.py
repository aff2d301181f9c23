"""Run a workload with a technique: check it fits, then launch it on every rank."""

from pathlib import Path

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from trainflow.errors import is_transient
from trainflow.launch.backends import launch_logged
from trainflow.paths import STOP_FILE
from trainflow.strategies import Technique
from trainflow.strategies.job import (
    Resources,
    TrainResult,
    Workload,
    check_before_launch,
    run_on_rank,
)


def retry_if_transient(_task: Task, _run: TaskRun, state: State) -> bool:
    """Retry what a relaunch can fix: a killed rank, a lost peer, a hang, a timeout, a
    preemption. An error raised by the code or the config would only fail again."""
    try:
        state.result()
    except Exception as exc:
        return is_transient(exc)
    return False


@task(name="train-with-technique", cache_policy=NO_CACHE, persist_result=False)
def _train_with_technique(
    workload: Workload, technique: Technique, resources: Resources
) -> TrainResult:
    check_before_launch(workload, technique, resources)
    # Creating this file stops the training as a preemption would, with no retry (a sweep's
    # pruner does; so can a person).
    options = resources.launch_options(stop_file=str(Path(workload.output_dir) / STOP_FILE))
    return launch_logged(run_on_rank, (workload, technique), {}, options).values[0]


def train_with_technique(
    workload: Workload, technique: Technique, resources: Resources
) -> TrainResult:
    """Fail before any rank starts if the technique cannot train the workload, else train.

    The training task is retried `resources.retries` times after a transient failure; each
    attempt continues from the latest complete checkpoint under `workload.resume_from`.
    Returns rank 0's result; rank output goes to the pipeline run's logs.
    """
    attempt = _train_with_technique.with_options(
        retries=resources.retries, retry_condition_fn=retry_if_transient
    )
    return attempt(workload, technique, resources)
