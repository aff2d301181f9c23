"""trainflow: distributed training as declarative pipelines.

`from trainflow import distributed, runtime` is the whole API for running a function on
every rank; pipelines live in `flows/`.
"""

from trainflow import runtime
from trainflow.errors import LaunchError, LaunchTimeoutError, PayloadError, RankError
from trainflow.launcher import DistributedFunction, LaunchOptions, LaunchResult, distributed, launch
from trainflow.resources import ResourceError

__all__ = [
    "DistributedFunction",
    "LaunchError",
    "LaunchOptions",
    "LaunchResult",
    "LaunchTimeoutError",
    "PayloadError",
    "RankError",
    "ResourceError",
    "distributed",
    "launch",
    "runtime",
]
