"""A sweep's tasks: the rank pool, one trial as a subflow run, the trial table artifact.

Trials run in the sweep's task-runner threads. The sweep stops one (pruned, or the sweep
itself stopped) through its run's stop file (`trainflow.paths.STOP_FILE`), which the launch
watches: the ranks checkpoint and end as on a preemption, and the pipeline ends its MLflow run
KILLED.
"""

import importlib
from typing import Any

from prefect import Flow, get_client, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import ObjectAlreadyExists
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


@task(name="trial", task_run_name="trial-{number}", cache_policy=NO_CACHE, persist_result=False)
def run_trial(pipeline: str, number: int, config: BaseModel) -> Any:
    """Run trial `number` as a subflow run of the pipeline (flow run `trial-<number>`)."""
    return pipeline_flow(pipeline).with_options(flow_run_name=f"trial-{number}")(config)


@task(name="publish-trials", cache_policy=NO_CACHE)
def publish_trials(key: str, title: str, table: str, figure: Any) -> str:
    """Show the trial table and the metric plot as one markdown artifact (same key: updated)."""
    markdown = f"# {title}\n\n{table}\n\n{figure_markdown(figure, 'metric by parameter')}\n"
    return str(create_markdown_artifact(key=key, markdown=markdown, description=title))
