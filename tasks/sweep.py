"""A sweep's tasks: the rank pool, one trial as a subflow run, the trial table artifact.

Trials run in the sweep's task-runner threads. Each records its thread while it runs, so the
sweep can stop it the way Ctrl-C stops a pipeline: an exception raised in that thread reaches
the launch, which asks the ranks to checkpoint and stop, and the pipeline ends its MLflow run.
"""

import base64
import ctypes
import importlib
import io
import threading
from typing import Any

from prefect import Flow, get_client, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import ObjectAlreadyExists
from pydantic import BaseModel

_threads: dict[str, int] = {}  # trial key -> the thread running it
_threads_lock = threading.Lock()


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
def run_trial(pipeline: str, number: int, config: BaseModel, key: str) -> Any:
    """Run trial `number` as a subflow run of the pipeline (flow run `trial-<number>`)."""
    with _threads_lock:
        _threads[key] = threading.get_ident()
    try:
        return pipeline_flow(pipeline).with_options(flow_run_name=f"trial-{number}")(config)
    finally:
        with _threads_lock:
            _threads.pop(key, None)


def interrupt_trial(key: str, exc_type: type[BaseException]) -> bool:
    """Raise `exc_type` in the thread running trial `key`; False when it is not running.

    The exception lands at the thread's next Python instruction: while training, that is the
    launcher's watch loop, which then stops the ranks gracefully (checkpoint, then exit).
    """
    with _threads_lock:
        ident = _threads.get(key)
        if ident is None:
            return False
        done = ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(ident), ctypes.py_object(exc_type)
        )
    return bool(done == 1)


@task(name="publish-trials", cache_policy=NO_CACHE)
def publish_trials(key: str, title: str, table: str, figure: Any) -> str:
    """Show the trial table and the metric plot as one markdown artifact (same key: updated)."""
    png = io.BytesIO()
    figure.savefig(png, format="png")
    encoded = base64.b64encode(png.getvalue()).decode()
    markdown = f"# {title}\n\n{table}\n\n![metric by parameter](data:image/png;base64,{encoded})\n"
    return str(create_markdown_artifact(key=key, markdown=markdown, description=title))
