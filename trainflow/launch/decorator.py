"""The decorator: `@distributed(gpus=...)` over a function gives it `.distributed()`, which
runs it on every rank through the backend its options choose (`trainflow.launch.backends`)."""

import functools
from collections.abc import Callable
from typing import Any, Generic, ParamSpec, TypeVar

from trainflow.launch import backends
from trainflow.launch.plan import resolve_resources
from trainflow.launch.spec import LaunchOptions

P = ParamSpec("P")
R = TypeVar("R")


class DistributedFunction(Generic[P, R]):
    """A function that runs in-process when called and on every rank via `.distributed()`."""

    def __init__(self, fn: Callable[P, R], options: LaunchOptions):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(*args, **kwargs)

    def distributed(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run on every rank; return the per-rank return values ordered by global rank.

        Inside a Prefect flow run the launch is its own task run and rank output goes to the
        run's logs; elsewhere rank output is printed with a `[rank N]` prefix.
        """
        return backends.call(self.fn, args, kwargs, self.options).values

    def __reduce__(self) -> Any:
        # Ship the plain function: ranks call it directly.
        return (_rebuild, (self.fn, self.options))


def _rebuild(fn: Callable[..., Any], options: LaunchOptions) -> DistributedFunction:
    return DistributedFunction(fn, options)


def distributed(
    gpus: int,
    gpu_type: str | None = None,
    *,
    nnodes: int | str = 1,
    timeout: float | None = None,
    init_process_group: bool = False,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    collective_timeout: float = 600.0,
    hang_timeout: float | None = None,
    stop_grace: float = 30.0,
    stop_file: str | None = None,
    remote: bool = False,
    ray_address: str | None = None,
    python: str | None = None,
) -> Callable[[Callable[P, R]], DistributedFunction[P, R]]:
    """Decorate a function so `fn.distributed(...)` runs it on `gpus` ranks.

    Args:
        gpus: Total number of ranks across all nodes (one GPU each when on GPUs).
        gpu_type: None uses what the machine has (GPUs, else CPU ranks with gloo); "cpu" forces
            CPU ranks; a GPU name ("H100", "A10") must match the GPUs present, unless
            TRAINFLOW_CPU_FALLBACK=1, which runs CPU ranks with a warning.
        nnodes: Number of nodes, or an elastic range "min:max". With more than one and a Ray
            cluster (`ray_address`, or RAY_ADDRESS), the call places every node on the cluster
            and returns all ranks' values (`trainflow.launch.ray_placement`). Without Ray, call
            `.distributed()` on every node with TRAINFLOW_RDZV_ENDPOINT and TRAINFLOW_RUN_ID set
            alike; each node returns the values of its own ranks. Or call it on the first node
            only, with TRAINFLOW_LAUNCH_BOARD set too, and run
            `python -m trainflow.launch.follower` on the others (`trainflow.launch.board`);
            the call returns the first node's values.
        timeout: Seconds for the whole call; past it every rank is stopped and
            `LaunchTimeoutError` names the ranks still running.
        init_process_group: Initialise the default process group (gloo on CPU, nccl on CUDA
            with the device bound to LOCAL_RANK) before the function and destroy it after.
        max_restarts: Times torch elastic restarts all ranks after a failure.
        env: Extra environment variables for every rank.
        collective_timeout: Seconds a rank waits for its peers in one collective before it
            fails (the timeout of `runtime.init_process_group`'s group); the launch then
            names the peers that stopped answering, with their stacks.
        hang_timeout: With ranks calling `runtime.heartbeat(step)`: when no rank advanced for
            this many seconds, every rank is stopped and `HangError` names each rank's last
            step and where it is stuck. None: no watchdog.
        stop_grace: Seconds the ranks get to write a final checkpoint when the caller is
            interrupted (Ctrl-C, a cancel) before they are killed; a second Ctrl-C kills at
            once. Also the agent's own grace when it is sent SIGTERM from outside.
        stop_file: A path another process may create to stop the launch as a preemption
            would (a final checkpoint, then the ranks end, within `stop_grace`); the call then
            raises `StopRequested`, which is not retried.
        remote: False runs the ranks on this machine. True submits the call to the Prefect
            deployment configured for `gpu_type` (TRAINFLOW_REMOTE_DEPLOYMENT_<TYPE> or
            TRAINFLOW_REMOTE_DEPLOYMENT, a deployment of `flows/remote.py:remote_call`), waits
            for it and returns its per-rank results; `RemoteNotConfiguredError` when none is
            set.
        ray_address: A Ray cluster ("ray://head:10001", "auto", "host:6379") to place the
            nodes on, even for one node; None: RAY_ADDRESS when `nnodes` is above 1.
        python: The interpreter of another virtual environment (a framework that cannot share
            this one, e.g. `.venvs/axolotl/bin/python`) to run the agent and ranks on; the
            caller stays where it is. The ranks keep the same environment contract, logs and
            failure reports; they see the caller's own folders on their import path but not
            its installed packages. The function travels by reference when it is importable
            there (define it in a module), so that environment must have what it imports.
    """
    options = LaunchOptions(
        gpus=gpus,
        gpu_type=gpu_type,
        nnodes=nnodes,
        timeout=timeout,
        init_process_group=init_process_group,
        max_restarts=max_restarts,
        env=dict(env or {}),
        collective_timeout=collective_timeout,
        hang_timeout=hang_timeout,
        stop_grace=stop_grace,
        stop_file=stop_file,
        remote=remote,
        ray_address=ray_address,
        python=python,
    )
    # Counts that can never work fail at decoration time; GPU presence is checked at launch.
    resolve_resources(options.gpus, "cpu", options.nnodes)

    def wrap(fn: Callable[P, R]) -> DistributedFunction[P, R]:
        return DistributedFunction(fn, options)

    return wrap
