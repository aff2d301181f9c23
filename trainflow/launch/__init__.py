"""Launching a function on every rank: the spec, the local elastic core, its backends and the
decorator on top. `docs/architecture.md` draws the layers; imports run one way, downwards:

    decorator                    `@distributed`, `DistributedFunction`
    backends                     `choose`, `launch`, `standby`: where the ranks run
      local, ray_placement,      one module per backend (`board`/`follower`: follower nodes;
      board, prefect_adapter       `prefect_adapter`: the one module that imports Prefect)
    supervisor, failures,        the local core: watch, stop and explain one node's launch
      diagnosis, logs, standby,
      environment, processes,
      ship, run_dir
    agent, worker, guard         what runs in the agent's and the ranks' processes
    spec, plan                   `LaunchOptions`, `LaunchSpec`, `LaunchResult`; the plan

This package imports none of its modules: import the one you need. Calling it calls
`backends.launch` (see `_Package`).
"""

import sys
import types
from typing import Any


class _Package(types.ModuleType):
    """`from trainflow import launch` gives the launch function (`backends.launch`), as it
    always has; once this package is imported, Python binds `trainflow.launch` to it instead.
    So the package calls the function: both spellings keep working.

    `backends` is loaded on the first call, not here: the agent and every rank import modules
    of this package (`spec`, `run_dir`) and need none of the backends.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from trainflow.launch.backends import launch

        return launch(*args, **kwargs)


sys.modules[__name__].__class__ = _Package
