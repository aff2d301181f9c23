"""The one module of `trainflow` that imports Prefect: rank output into Prefect run logs.

`DistributedFunction.distributed()` only imports this when Prefect is already loaded, so the
library and every rank stay free of Prefect.
"""

from collections.abc import Callable
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext, TaskRunContext

from trainflow.launcher import LaunchOptions, LaunchResult, launch


def in_prefect_run() -> bool:
    """True inside a Prefect flow run or task run."""
    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def launch_logged(
    fn: Callable[..., Any], args: tuple, kwargs: dict, options: LaunchOptions
) -> LaunchResult:
    """Launch from inside a Prefect run, forwarding each rank line to the run's logs."""
    logger = get_run_logger()
    result = launch(
        fn,
        args,
        kwargs,
        options=options,
        on_line=lambda r, line: logger.info("[rank %d] %s", r, line),
    )
    files = "\n".join(f"| {r} | `{p}` |" for r, p in result.log_files.items())
    logger.info("Full rank logs: %s", result.run_dir / "logs")
    create_markdown_artifact(
        key="rank-logs",
        markdown=(
            f"### Rank logs of `{getattr(fn, '__name__', 'fn')}`\n\n"
            f"{result.resources.world_size} ranks on {result.resources.device}\n\n"
            f"| rank | log file |\n|---|---|\n{files}\n"
        ),
        description="Where each rank's full stdout/stderr is kept",
    )
    return result


def launch_in_prefect(
    fn: Callable[..., Any], args: tuple, kwargs: dict, options: LaunchOptions
) -> LaunchResult:
    """In a flow, the launch becomes its own task run; inside a task it logs to that task."""
    if TaskRunContext.get() is not None:
        return launch_logged(fn, args, kwargs, options)
    name = getattr(fn, "__name__", "fn")
    as_task = task(
        name=f"{name}.distributed",
        task_run_name=f"{name}.distributed[{options.gpus}]",
        cache_policy=NO_CACHE,
        persist_result=False,
    )(launch_logged)
    return as_task(fn, args, kwargs, options)


__all__ = ["in_prefect_run", "launch_in_prefect", "launch_logged"]
