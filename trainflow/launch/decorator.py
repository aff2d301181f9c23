"""The decorator: `@distributed(...)` over a function gives it `.distributed()`, which runs it
on every rank through the backend its options choose (`trainflow.launch.backends`).

The ranks may be asked for in two spellings: `num_accelerators` and `accelerator_type`
("GPU_8xH100": nodes of 8 H100s, `plan.ACCELERATOR_TYPES`), or the earlier `gpus` and
`gpu_type` ("H100", "cpu"). Both map to the same `LaunchOptions`; they differ in one default,
the timeout: `DEFAULT_TIMEOUT_S` for the first, none for the second, so that runs written for
the earlier spelling are not stopped after three hours.
"""

import dataclasses
import enum
import functools
import sys
from collections.abc import Callable
from typing import Any, Generic, Literal, ParamSpec, TypeVar

from trainflow.launch import backends
from trainflow.launch.plan import ResourceError, is_accelerator_name, place, resolve_resources
from trainflow.launch.spec import LaunchOptions

P = ParamSpec("P")
R = TypeVar("R")

# The timeout of a call in the new spelling that gives none: past it every rank is stopped.
DEFAULT_TIMEOUT_S = 10800.0


class _NotGiven(enum.Enum):
    NOT_GIVEN = "not given"

    def __repr__(self) -> str:
        return "<not given>"


# Marks an argument left out, where None is a value of its own (`timeout=None`: no limit).
NOT_GIVEN = _NotGiven.NOT_GIVEN
NotGiven = Literal[_NotGiven.NOT_GIVEN]


@dataclasses.dataclass(frozen=True)
class Request:
    """The ranks asked for, as given (None: left out), kept so that `with_overrides` maps a
    changed field the way the decorator did."""

    count: int | None
    # An accelerator type, a GPU name, "cpu", or None.
    kind: str | None
    nnodes: int | str | None
    # The name the count was given as, for messages.
    count_name: str = "num_accelerators"

    def placed(self, remote: bool) -> dict[str, Any]:
        """`gpus`, `gpu_type` and `nnodes` of the launch options (`plan.place`)."""
        return place(self.count, self.kind, self.nnodes, remote, self.count_name)._asdict()


class DistributedFunction(Generic[P, R]):
    """A function that runs in-process when called and on every rank via `.distributed()`."""

    def __init__(
        self,
        fn: Callable[P, R],
        options: LaunchOptions,
        request: Request | None = None,
        default_timeout: bool = False,
    ):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options
        self.request = request or Request(options.gpus, options.gpu_type, options.nnodes, "gpus")
        # Whether `options.timeout` is `DEFAULT_TIMEOUT_S` because none was given.
        self.default_timeout = default_timeout

    @property
    def func(self) -> Callable[P, R]:
        """The plain function."""
        return self.fn

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(*args, **kwargs)

    def distributed(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run on every rank; return the per-rank return values ordered by global rank.

        Inside a Prefect flow run the launch is its own task run and rank output goes to the
        run's logs; elsewhere rank output is printed with a `[rank N]` prefix. When the default
        timeout applies, one line on stderr says so first.
        """
        note = self.timeout_note()
        if note is not None:
            print(note, file=sys.stderr, flush=True)
        return backends.call(self.fn, args, kwargs, self.options).values

    def timeout_note(self) -> str | None:
        """The line `.distributed()` prints when the default timeout applies, else None."""
        if not self.default_timeout or self.options.timeout is None:
            return None
        seconds = self.options.timeout
        return (
            f"[trainflow] Note: {getattr(self.fn, '__name__', 'fn')}.distributed() stops its "
            f"ranks after {_duration(seconds)} (timeout={seconds:g} s, the default); pass "
            "timeout=None to run without a limit."
        )

    def with_overrides(
        self,
        num_accelerators: int | None | NotGiven = NOT_GIVEN,
        accelerator_type: str | None | NotGiven = NOT_GIVEN,
        remote: bool | NotGiven = NOT_GIVEN,
        timeout: float | None | NotGiven = NOT_GIVEN,
    ) -> "DistributedFunction[P, R]":
        """A new decorated function with the options given replaced; this one is unchanged.

        Each argument means what it means to `distributed` and is checked the same way; one
        left out keeps this function's value (a count left out by both is counted again).
        A new accelerator type decides the nodes itself.

        Raises:
            ResourceError: as `distributed` does, naming the field.
        """
        request = self.request
        if num_accelerators is not NOT_GIVEN:
            request = dataclasses.replace(
                request, count=num_accelerators, count_name="num_accelerators"
            )
        if accelerator_type is not NOT_GIVEN:
            nnodes = None if is_accelerator_name(accelerator_type) else request.nnodes
            request = dataclasses.replace(request, kind=accelerator_type, nnodes=nnodes)
        on_remote = self.options.remote if remote is NOT_GIVEN else remote
        changes: dict[str, Any] = {"remote": on_remote, **request.placed(on_remote)}
        if timeout is not NOT_GIVEN:
            changes["timeout"] = timeout
        options = dataclasses.replace(self.options, **changes)
        resolve_resources(options.gpus, "cpu", options.nnodes)
        default_timeout = self.default_timeout and timeout is NOT_GIVEN
        return DistributedFunction(self.fn, options, request, default_timeout)

    def __reduce__(self) -> Any:
        # Ship the plain function: ranks call it directly.
        return (_rebuild, (self.fn, self.options, self.request, self.default_timeout))


def _rebuild(
    fn: Callable[..., Any],
    options: LaunchOptions,
    request: Request | None = None,
    default_timeout: bool = False,
) -> DistributedFunction:
    return DistributedFunction(fn, options, request, default_timeout)


def _duration(seconds: float) -> str:
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"


def distributed(
    num_accelerators: int | None = None,
    accelerator_type: str | None = None,
    remote: bool = False,
    timeout: float | None | NotGiven = NOT_GIVEN,
    *,
    gpus: int | None = None,
    gpu_type: str | None = None,
    nnodes: int | str | None = None,
    init_process_group: bool = False,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    collective_timeout: float = 600.0,
    hang_timeout: float | None = None,
    stop_grace: float = 30.0,
    stop_file: str | None = None,
    ray_address: str | None = None,
    python: str | None = None,
) -> Callable[[Callable[P, R]], DistributedFunction[P, R]]:
    """Decorate a function so `fn.distributed(...)` runs it on every rank.

    The ranks are asked for as `num_accelerators` and `accelerator_type`, or in the earlier
    spelling as `gpus` and `gpu_type`; the first argument is the count in both. A second
    argument that is not an accelerator type ("cpu", "H100") is the earlier `gpu_type`, and
    the call is in the earlier spelling. Giving one setting under both names is an error.

    Args:
        num_accelerators: Total number of ranks across all nodes (one GPU each when on GPUs).
            None: every GPU attached to this machine (at most one node of `accelerator_type`),
            counted when the decorator runs; without GPUs, one CPU rank. With `remote=True`,
            one node of `accelerator_type`.
        accelerator_type: The kind of node: "GPU_1xA10", "GPU_1xH100", "GPU_8xH100" or
            "GPU_8xB300", the GPU and how many each node has. A count up to a node's GPUs runs
            on one node, a multiple of it on whole nodes ("GPU_8xH100" with 16: 2 nodes of 8);
            any other count, or another type, fails here. None: what `gpu_type=None` does.
        remote: False runs the ranks on this machine. True submits the call to the Prefect
            deployment configured for the GPU type (TRAINFLOW_REMOTE_DEPLOYMENT_<TYPE> or
            TRAINFLOW_REMOTE_DEPLOYMENT, a deployment of `flows/remote.py:remote_call`), waits
            for it and returns its per-rank results; `RemoteNotConfiguredError` when none is
            set.
        timeout: Seconds for the whole call; past it every rank is stopped and
            `LaunchTimeoutError` names the ranks still running. Left out: `DEFAULT_TIMEOUT_S`
            (3 h, said in one line on stderr at each call) in this spelling, none in the
            earlier one; remote calls alike, timed where the ranks run. None: no limit.
        gpus: The earlier name of `num_accelerators`. The earlier names raise no warning;
            a call that uses one is in the earlier spelling (no default timeout).
        gpu_type: The earlier way to name the GPUs: None uses what the machine has (GPUs,
            else CPU ranks with gloo); "cpu" forces CPU ranks; a GPU name ("H100", "A10") must
            match the GPUs present, unless TRAINFLOW_CPU_FALLBACK=1, which runs CPU ranks
            with a warning (as it does for an accelerator type's GPU).
        nnodes: Number of nodes, or an elastic range "min:max"; None: one, or what
            `accelerator_type` implies (given with it, it must agree). With more than one and a
            Ray cluster (`ray_address`, or RAY_ADDRESS), the call places every node on the
            cluster and returns all ranks' values (`trainflow.launch.ray_placement`). Without
            Ray, call `.distributed()` on every node with TRAINFLOW_RDZV_ENDPOINT and
            TRAINFLOW_RUN_ID set alike; each node returns the values of its own ranks. Or call
            it on the first node only, with TRAINFLOW_LAUNCH_BOARD set too, and run
            `python -m trainflow.launch.follower` on the others (`trainflow.launch.board`);
            the call returns the first node's values.
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
        ray_address: A Ray cluster ("ray://head:10001", "auto", "host:6379") to place the
            nodes on, even for one node; None: RAY_ADDRESS when there is more than one node.
        python: The interpreter of another virtual environment (a framework that cannot share
            this one, e.g. `.venvs/axolotl/bin/python`) to run the agent and ranks on; the
            caller stays where it is. The ranks keep the same environment contract, logs and
            failure reports; they see the caller's own folders on their import path but not
            its installed packages. The function travels by reference when it is importable
            there (define it in a module), so that environment must have what it imports.

    Returns:
        The decorator; the `DistributedFunction` it makes also has `.func` (the plain
        function) and `.with_overrides(...)`, and calling it runs the function in-process.

    Raises:
        ResourceError: an unknown accelerator type, a count that is not positive or that the
            type cannot hold, one setting under both names, or nodes that disagree with the
            type, each naming the fields; nothing is decorated.
    """
    request, earlier = _request(num_accelerators, accelerator_type, gpus, gpu_type, nnodes)
    default_timeout = timeout is NOT_GIVEN and not earlier
    if timeout is NOT_GIVEN:
        timeout = DEFAULT_TIMEOUT_S if default_timeout else None
    options = LaunchOptions(
        **request.placed(remote),
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
        return DistributedFunction(fn, options, request, default_timeout)

    return wrap


def _request(
    num_accelerators: int | None,
    accelerator_type: str | None,
    gpus: int | None,
    gpu_type: str | None,
    nnodes: int | str | None,
) -> tuple[Request, bool]:
    """The request, and whether it is in the earlier spelling: `gpus` or `gpu_type` given
    (beside a new name too), or a GPU name or "cpu" where the accelerator type goes."""
    for new, old, new_value, old_value in (
        ("num_accelerators", "gpus", num_accelerators, gpus),
        ("accelerator_type", "gpu_type", accelerator_type, gpu_type),
    ):
        if new_value is not None and old_value is not None:
            raise ResourceError(
                f"{new}={new_value!r} and {old}={old_value!r} both given: they are one setting "
                f"under two names ({old} is the earlier one); pass one of them"
            )
    kind = gpu_type if gpu_type is not None else accelerator_type
    earlier = gpus is not None or gpu_type is not None
    earlier = earlier or (kind is not None and not is_accelerator_name(kind))
    if gpus is not None:
        return Request(gpus, kind, nnodes, "gpus"), earlier
    return Request(num_accelerators, kind, nnodes), earlier
