"""trainflow: distributed training as declarative pipelines.

`from trainflow import distributed, runtime` is the whole API for running a function on
every rank; pipelines live in `flows/`.

Names are imported on first use: configs, `--help` and deployment validation read
`trainflow.configs` and `trainflow.resources` without paying for torch.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainflow import runtime
    from trainflow.errors import (
        FrameworkError,
        LaunchError,
        LaunchTimeoutError,
        PayloadError,
        RankError,
        RemoteNotConfiguredError,
        SingleProcessFrameworkError,
    )
    from trainflow.launch.backends import launch
    from trainflow.launch.decorator import DistributedFunction, distributed
    from trainflow.launch.plan import ResourceError
    from trainflow.launch.spec import LaunchOptions, LaunchResult
    from trainflow.resources import Resources

_EXPORTS = {
    "DistributedFunction": "trainflow.launch.decorator",
    "FrameworkError": "trainflow.errors",
    "LaunchError": "trainflow.errors",
    "LaunchOptions": "trainflow.launch.spec",
    "LaunchResult": "trainflow.launch.spec",
    "LaunchTimeoutError": "trainflow.errors",
    "PayloadError": "trainflow.errors",
    "RankError": "trainflow.errors",
    "RemoteNotConfiguredError": "trainflow.errors",
    "SingleProcessFrameworkError": "trainflow.errors",
    "ResourceError": "trainflow.launch.plan",
    "Resources": "trainflow.resources",
    "distributed": "trainflow.launch.decorator",
    "launch": "trainflow.launch.backends",
}

__all__ = [
    "DistributedFunction",
    "FrameworkError",
    "LaunchError",
    "LaunchOptions",
    "LaunchResult",
    "LaunchTimeoutError",
    "PayloadError",
    "RankError",
    "RemoteNotConfiguredError",
    "ResourceError",
    "Resources",
    "SingleProcessFrameworkError",
    "distributed",
    "launch",
    "runtime",
]


def __getattr__(name: str) -> Any:
    if name == "runtime":
        return importlib.import_module("trainflow.runtime")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainflow' has no attribute {name!r}")
