"""A sweep's tasks: the rank pool, one trial as a subflow run, the trial table artifact.

Trials run in the sweep's task-runner threads. The sweep stops one (pruned, or the sweep
itself stopped) through its run's stop file (`trainflow.paths.STOP_FILE`), which the launch
watches: the ranks checkpoint and end as on a preemption, and the pipeline ends its MLflow run
KILLED. The trials a stopped sweep stopped then end Cancelled (`cancel_trials`), as the sweep
does.
"""

import importlib
from collections.abc import Mapping
from typing import Any

from prefect import Flow, get_client, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterName,
    FlowRunFilterParentFlowRunId,
)
from prefect.exceptions import ObjectAlreadyExists
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run
from prefect.states import Cancelled
from pydantic import BaseModel

from tasks.reporting import figure_markdown


def pipeline_flow(pipeline: str) -> Flow[..., Any]:
    """The pipeline's flow (`flows/<pipeline>.py`)."""
    return getattr(importlib.import_module(f"flows.{pipeline}"), pipeline)


@task(name="ensure-rank-pool", cache_policy=NO_CACHE)
def ensure_rank_pool(name: str, size: int) -> None:
    """Create the global concurrency limit `name` with `size` slots, or set its size."""
    with get_client(sync_client=True) as client:
        try:
            client.upsert_global_concurrency_limit_by_name(name, size)
        except ObjectAlreadyExists:  # another sweep created it meanwhile
            client.upsert_global_concurrency_limit_by_name(name, size)


def trial_run_name(number: int) -> str:
    """The name of trial `number`'s subflow run."""
    return f"trial-{number}"


@task(name="trial", task_run_name="trial-{number}", cache_policy=NO_CACHE, persist_result=False)
def run_trial(pipeline: str, number: int, config: BaseModel) -> Any:
    """Run trial `number` as a subflow run of the pipeline (flow run `trial-<number>`)."""
    return pipeline_flow(pipeline).with_options(flow_run_name=trial_run_name(number))(config)


def cancel_trials(trials: Mapping[int, PrefectFuture[Any]], message: str) -> None:
    """End stopped trials (number -> `run_trial` future) Cancelled: their task runs, their
    subflow runs and the subflow runs below those that did not complete.

    A trial the sweep stops ends its pipeline with an error (`StopRequested`), so Prefect
    would show it Failed, and the server's cancellation clean-up leaves a run that has ended
    alone. Not a task: it runs while the sweep's own flow run is being stopped.
    """
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.get_id()]),
                name=FlowRunFilterName(any_=[trial_run_name(n) for n in trials]),
            )
        )
        while runs:  # the trials, then the subflow runs under them
            for run in runs:
                if not run.state or not run.state.is_completed():
                    client.set_flow_run_state(run.id, Cancelled(message=message), force=True)
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[r.id for r in runs])
                )
            )
        for future in trials.values():
            client.set_task_run_state(future.task_run_id, Cancelled(message=message), force=True)


@task(name="publish-trials", cache_policy=NO_CACHE)
def publish_trials(key: str, title: str, table: str, figure: Any) -> str:
    """Show the trial table and the metric plot as one markdown artifact (same key: updated)."""
    markdown = f"# {title}\n\n{table}\n\n{figure_markdown(figure, 'metric by parameter')}\n"
    return str(create_markdown_artifact(key=key, markdown=markdown, description=title))
