"""Launch a workload's training function on every rank."""

from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from trainflow import LaunchOptions
from trainflow.prefect_adapter import launch_logged


@task(name="train", cache_policy=NO_CACHE, persist_result=False)
def launch_training(
    train_fn: Callable[..., Any],
    args: tuple,
    options: LaunchOptions,
) -> list[Any]:
    """Run `train_fn(*args)` on every rank; rank output goes to this task's logs.

    Not retried: a rerun would start training from scratch.
    """
    return launch_logged(train_fn, args, {}, options).values
