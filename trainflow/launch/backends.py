"""Where a launch's ranks run: one `Backend` per way of placing them, chosen in one place.

`choose` reads the launch options, in this order:

    remote=True                                  prefect_adapter.RemoteDeployment
    a Ray cluster (ray_address, or RAY_ADDRESS   ray_placement.RayLaunch
      with nnodes above 1)
    this process leads follower nodes            board.Lead
      (TRAINFLOW_LAUNCH_BOARD, nnodes above 1)
    anything else                                local.LocalLaunch: torch's elastic agent
                                                   on this machine

Every backend but the remote one ends in a `LocalLaunch` on each node it places.

Prefect is imported only for a remote call or inside a Prefect run, so that plain scripts and
every rank stay free of its import cost: a process that has not imported Prefect is in no
Prefect run, and `prefect_adapter` (the one module that imports it) is loaded on first need.
"""

import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from trainflow.errors import RemoteNotConfiguredError
from trainflow.launch import board
from trainflow.launch import standby as standby_agents
from trainflow.launch.environment import interpreter, launch_env, start_method
from trainflow.launch.local import LocalLaunch
from trainflow.launch.logs import print_line
from trainflow.launch.plan import (
    check_cpu_oversubscription,
    node_range,
    ray_cluster_address,
    resolve_resources,
)
from trainflow.launch.ray_placement import RayLaunch, ray_address
from trainflow.launch.ship import Shipment, ship
from trainflow.launch.spec import (
    REMOTE_DEPLOYMENT_ENV,
    STANDBY_ENV,
    LaunchOptions,
    LaunchResult,
    LineSink,
)
from trainflow.launch.standby import AgentAhead, Call

if TYPE_CHECKING:
    from types import ModuleType


class Backend(Protocol):
    """Runs a shipped call on its ranks, wherever it places them."""

    def run(self, shipment: Shipment) -> LaunchResult: ...


@dataclass
class Lead:
    """This process leads follower nodes: it publishes the call on its launch board and runs
    the first node's share (`trainflow.launch.board`)."""

    board: board.Board
    options: LaunchOptions
    on_line: LineSink | None = None

    def run(self, shipment: Shipment) -> LaunchResult:
        return board.lead(self.board, shipment, self.options, self.on_line)


def choose(options: LaunchOptions, on_line: LineSink | None = None) -> Backend:
    """The backend a launch with `options` runs on (see the module doc)."""
    if options.remote:
        deployment = remote_deployment(options.gpu_type)  # fails before anything runs
        return _prefect_adapter().RemoteDeployment(deployment, options)
    if ray_address(options):
        return RayLaunch(options, on_line)
    leader = _leader_board(options)
    if leader is not None:
        return Lead(leader, options, on_line)
    return LocalLaunch(options, on_line or print_line)


def launch(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    options: LaunchOptions,
    on_line: LineSink | None = None,
) -> LaunchResult:
    """Run `fn(*args, **kwargs)` on every rank and return all results with the run's log files.

    Args:
        fn: Any picklable callable (functions from `__main__`, closures and lambdas included).
        args: Positional arguments, shipped to every rank.
        kwargs: Keyword arguments, shipped to every rank.
        options: Resources, timeout, restarts and environment for the launch.
        on_line: Called with `(rank, line)` for every line a rank prints; by default lines are
            printed with a `[rank N]` prefix.

    Raises:
        ResourceError: the requested GPUs are not on this machine (nothing started).
        PayloadError: the function or an argument cannot be pickled (nothing started).
        RankError: a rank raised; names the first failing rank, with its traceback.
        LaunchTimeoutError: the launch ran past `options.timeout`; names the ranks stopped.
        HangError: no rank advanced for `options.hang_timeout`, or ranks stopped answering
            their peers in a collective; names them, with their stacks.
        LaunchError: the agent or a rank died without a Python error (signal, OOM, ...).

    Interrupted (KeyboardInterrupt or any other exception raised in this thread while it
    waits), it gives the ranks `options.stop_grace` seconds to stop cleanly, kills what is
    left and re-raises.
    """
    backend = choose(options, on_line)
    return backend.run(ship(fn, tuple(args), dict(kwargs or {})))


def launch_logged(
    fn: Callable[..., Any], args: tuple, kwargs: dict, options: LaunchOptions
) -> LaunchResult:
    """`launch` from inside a Prefect run: each rank line goes to the pipeline run's logs, and
    the run gets an artifact saying where the rank logs are."""
    name = getattr(fn, "__name__", "fn")
    return _prefect_adapter().launch_logged(
        name, options, lambda sink: launch(fn, args, kwargs, options=options, on_line=sink)
    )


def launch_in_prefect(
    fn: Callable[..., Any], args: tuple, kwargs: dict, options: LaunchOptions
) -> LaunchResult:
    """In a flow, the launch becomes its own task run; inside a task it logs to that task."""
    adapter = _prefect_adapter()
    if adapter.in_task_run():
        return launch_logged(fn, args, kwargs, options)
    name = getattr(fn, "__name__", "fn")
    return adapter.as_task_run(
        name, options, lambda sink: launch(fn, args, kwargs, options=options, on_line=sink)
    )


def call(fn: Callable[..., Any], args: tuple, kwargs: dict, options: LaunchOptions) -> LaunchResult:
    """What `.distributed()` does: `launch`, logged to the Prefect run it is called in."""
    if not options.remote and in_prefect_run():
        return launch_in_prefect(fn, args, kwargs, options)
    return launch(fn, args, kwargs, options=options)


def in_prefect_run() -> bool:
    """Whether this thread runs inside a Prefect flow or task run (see the module doc)."""
    return "prefect" in sys.modules and _prefect_adapter().in_prefect_run()


def remote_deployment(gpu_type: str | None) -> str:
    """The Prefect deployment a `remote=True` call runs on, for this GPU type.

    TRAINFLOW_REMOTE_DEPLOYMENT_<GPU TYPE> (e.g. `_H100`) first, then
    TRAINFLOW_REMOTE_DEPLOYMENT; each names a deployment of `flows/remote.py:remote_call`
    ("remote-call/h100") on a work pool whose workers have those GPUs.

    Raises:
        RemoteNotConfiguredError: neither is set; says how to set one up.
    """
    suffix = re.sub(r"[^A-Z0-9]+", "_", (gpu_type or "").upper()).strip("_")
    names = ([f"{REMOTE_DEPLOYMENT_ENV}_{suffix}"] if suffix else []) + [REMOTE_DEPLOYMENT_ENV]
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    raise RemoteNotConfiguredError(
        f"remote=True needs a Prefect deployment to run the call on, and none is configured: "
        f"set {' or '.join(names)} to the name of a deployment of "
        "flows/remote.py:remote_call (e.g. 'remote-call/h100') on a work pool with "
        f"{gpu_type or 'GPU'} workers. `prefect deploy --name remote-call/cpu-local` creates one "
        "from prefect.yaml; see docs/notebooks.md. Or use remote=False to run the ranks here."
    )


def standby(
    options: LaunchOptions,
    preload: Sequence[str] = (),
    check: Call | None = None,
    then: Sequence[Call] = (),
) -> AgentAhead:
    """Start the agent of a launch with `options` now, importing `preload` (module names).

    The next `launch` with the same options in this process and working directory uses it
    (any thread); a launch with other options starts its own. An unused agent for the same
    options already waiting is kept instead of starting another. Returns a call that stops the
    agent if no launch has used it (call it when the launch will not come, e.g. when the
    pipeline ends). Nothing happens for remote launches, or with TRAINFLOW_STANDBY=0.

    `check`, (`module:function`, a JSON value): a check the agent runs once its imports are
    done, before any launch claims it, where the workload's libraries are loaded (the model
    built on the meta device, a config read with transformers): the caller's process need not
    import them. `AgentAhead.check_outcome` gives what it found. `then`: more such calls, run
    in order after the check and before the imports (an SFT run's dataset, prepared where
    `datasets` and `streaming` will be imported anyway); `AgentAhead.outcome(call)` gives each
    one's outcome. After a call that does not return a value, the rest are skipped.

    A process that leads follower nodes (`trainflow.launch.board`) starts its launch board
    here for a multi-node launch, TRAINFLOW_STANDBY=0 or not: its followers wait for it.
    """
    if options.remote or ray_cluster_address(options.nnodes, options.ray_address):
        return AgentAhead()  # the ranks run elsewhere
    # A leader's followers wait for its launch board: it comes up with the pipeline.
    _leader_board(options)
    if os.environ.get(STANDBY_ENV) == "0":
        return AgentAhead()
    res = resolve_resources(options.gpus, options.gpu_type, options.nnodes)
    check_cpu_oversubscription(res)
    key = standby_agents.AgentKey(launch_env(options, res), start_method(res), interpreter(options))
    return standby_agents.prewarm(key, preload, check, then)


def _leader_board(options: LaunchOptions) -> board.Board | None:
    """The launch board this process hosts for follower nodes, for a multi-node launch that no
    Ray cluster places; None otherwise, or when not enabled."""
    if node_range(options.nnodes)[1] == 1 or ray_cluster_address(
        options.nnodes, options.ray_address
    ):
        return None
    return board.leader_board()


def _prefect_adapter() -> "ModuleType":
    # Imported on first need only: see the module doc.
    from trainflow.launch import prefect_adapter

    return prefect_adapter
