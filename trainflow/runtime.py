"""Rank discipline in one place: who am I, which device is mine, a process group pair, and
how a rank hears that it should stop or says that it is still making progress.

Every helper reads the torchrun/torch-elastic environment, so it gives the same answer under
`trainflow.distributed`, `torchrun`, Ray or a plain `python` process (rank 0 of 1).
"""

import contextlib
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainflow.launch.run_dir import Heartbeat, RunDir
from trainflow.launch.spec import RUN_DIR_ENV

# Set by the launcher's worker on every rank: the launch's run directory, and the bound on a
# collective (`LaunchOptions.collective_timeout`).
COLLECTIVE_TIMEOUT_ENV = "TRAINFLOW_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0

_stop_requested = False
_stop_check_recorded = False
# (default group, the gloo group of the stop check made beside it, the checks made on it)
_control: tuple[Any, Any, "_StopChecks"] | None = None
_heartbeat: tuple[str, Heartbeat] | None = None  # (run directory, this rank's open file)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def get_global_rank() -> int:
    """Rank of this process among all processes of the job (0 outside a launch)."""
    return _env_int("RANK", 0)


def get_local_rank() -> int:
    """Rank of this process on its node (0 outside a launch)."""
    return _env_int("LOCAL_RANK", 0)


def get_world_size() -> int:
    """Number of processes in the job (1 outside a launch)."""
    return _env_int("WORLD_SIZE", 1)


def get_local_world_size() -> int:
    """Number of processes of the job on this node (1 outside a launch)."""
    return _env_int("LOCAL_WORLD_SIZE", 1)


def _attempt() -> int:
    """Which restart of the workers this is (0: the first start)."""
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def get_node_rank() -> int:
    """Rank of this node among the job's nodes (0 outside a launch)."""
    return _env_int("NODE_RANK", _env_int("GROUP_RANK", 0))


def is_rank_zero() -> bool:
    """True on the one process that owns logging, checkpoints and results."""
    return get_global_rank() == 0


def print0(*args: object, **kwargs: object) -> None:
    """`print` on global rank 0 only."""
    if is_rank_zero():
        print(*args, **kwargs, flush=True)  # type: ignore[call-overload]


def get_device() -> torch.device:
    """The device this rank should compute on.

    `cuda:LOCAL_RANK` when the launch assigned GPUs (or, outside a launch, when CUDA is present),
    else `cpu`.
    """
    kind = os.environ.get("TRAINFLOW_DEVICE")
    if kind is None:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        return torch.device("cuda", get_local_rank())
    return torch.device("cpu")


def backend_for(device_type: str) -> str:
    """The process-group backend for ranks on `device_type`: nccl on CUDA, gloo otherwise."""
    return "nccl" if device_type == "cuda" else "gloo"


def default_backend() -> str:
    """nccl for CUDA ranks, gloo for CPU ranks."""
    return backend_for(get_device().type)


def collective_timeout_s() -> float:
    """The launch's bound on one collective (TRAINFLOW_COLLECTIVE_TIMEOUT_S), else 600 s."""
    value = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    return DEFAULT_COLLECTIVE_TIMEOUT_S if value in (None, "") else float(value)


def init_process_group(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Initialise the default process group from the launcher's environment.

    On CUDA the rank's device is bound to `LOCAL_RANK` first. When the launcher restarts
    workers (`max_restarts > 0`) the agent's store is reused across attempts, so each attempt
    gets its own key prefix: a restarted rank never reads a dead rank's address.

    `timeout_s` (default: the launch's `collective_timeout`) bounds every collective: a rank
    whose peer stopped answering fails after it instead of waiting forever, and the launcher
    then names the peer. Under the launcher a group the user's code creates with
    `dist.init_process_group` and no `timeout=` gets the same bound (`compat.torch`).
    """
    backend = backend or default_backend()
    if timeout_s is None:
        timeout_s = collective_timeout_s()
    if backend == "nccl":
        torch.cuda.set_device(get_local_rank())
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timeout,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"attempt_{attempt}", store),
            rank=get_global_rank(),
            world_size=get_world_size(),
            timeout=timeout,
        )
    else:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)


def destroy_process_group() -> None:
    """Tear down the default group if one exists (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        if _control is not None and _control[0] is dist.group.WORLD:
            _control[2].drain()  # the last stop check, if still in flight
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(backend: str | None = None) -> Iterator[None]:
    """`init_process_group` and `destroy_process_group` as a pair, cleanup in `finally`."""
    init_process_group(backend)
    try:
        yield
    finally:
        destroy_process_group()


def request_stop() -> None:
    """Note that this rank should stop at the end of its current step.

    What the launcher's SIGTERM handler calls on every rank (a preemption, Ctrl-C or a cancel
    upstream); a rank may call it too, e.g. on its platform's own preemption notice.
    """
    global _stop_requested
    _stop_requested = True


def stop_requested() -> bool:
    """Whether this process was asked to stop (SIGTERM under the launcher); False elsewhere.

    Local to this rank: a training loop should ask `should_stop()`, which all ranks answer alike.
    """
    return _stop_requested


# Steps at least this long (on some rank) wait for each stop check; shorter ones leave it in
# flight and read it at the next step.
STOP_CHECK_WAIT_STEP_S = 0.2
# Shorter steps are checked about this often, not after every step: one check per step costs
# a collective per step (0.5-1 ms of a core on 2 busy CPU ranks, beside a 50 ms step).
STOP_CHECK_EVERY_S = 0.25
STOP_CHECK_MAX_SPACING = 64  # steps between checks, however short the steps


class _StopChecks:
    """The stop checks of one process group: which call checks next, whether it waits for its
    own all-reduce, and the check in flight.

    Every decision comes from the results the ranks agreed on, applied at the same call on
    every rank, so the ranks check, wait and stop at the same steps.
    """

    def __init__(self) -> None:
        # The first check, and any after a long step, wait for their own all-reduce.
        self.wait = True
        self.spacing = 1  # calls from one check to the next
        self.calls = 0
        self.next_check = 1  # the call that checks next
        # [any rank stopping, any rank's steps long, the longest mean step in microseconds]
        self.in_flight: tuple[Any, torch.Tensor] | None = None
        self.checked: tuple[float, int] | None = None  # (when, at which call) this rank checked

    def _agree(self, flags: torch.Tensor) -> bool:
        """Apply an agreed result: how the next checks go; whether to stop."""
        stopping, self.wait, step_us = bool(flags[0]), bool(flags[1]), int(flags[2])
        if self.wait or step_us <= 0:
            self.spacing = 1
        else:
            every = int(STOP_CHECK_EVERY_S * 1e6) // step_us
            self.spacing = max(1, min(STOP_CHECK_MAX_SPACING, every))
        return stopping

    def check(self, group: Any) -> bool:
        self.calls += 1
        answer = False
        if self.in_flight is not None:  # it had the whole last step to arrive
            work, flags = self.in_flight
            work.wait()
            self.in_flight = None
            answer = self._agree(flags)
        if self.calls < self.next_check:
            return answer
        now = time.monotonic()
        if self.checked is None:
            step_s, slow = 0.0, True
        else:
            step_s = (now - self.checked[0]) / max(self.calls - self.checked[1], 1)
            slow = step_s >= STOP_CHECK_WAIT_STEP_S
        self.checked = (now, self.calls)
        step_us = min(int(step_s * 1e6), 2**31 - 1)
        flags = torch.tensor([int(_stop_requested), int(slow), step_us], dtype=torch.int32)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
        if self.wait:
            work.wait()
            answer = self._agree(flags) or answer
        else:
            self.in_flight = (work, flags)
        self.next_check = self.calls + self.spacing
        return answer

    def drain(self) -> None:
        if self.in_flight is not None:
            with contextlib.suppress(Exception):  # a peer that is gone: nothing to agree on
                self.in_flight[0].wait()
            self.in_flight = None


def should_stop() -> bool:
    """Whether any rank was asked to stop: call at the end of every optimizer step, on all ranks.

    A stop request reaches the ranks at different moments (a SIGTERM to one node, or to every
    rank but handled between different instructions). With a default process group this is a
    collective: the ranks all-reduce (MAX) their flags on a gloo group of their own, so every
    rank sees the same answer at the same step and they all write the final checkpoint of that
    step together. Without a group it is `stop_requested()`.

    A blocking check costs every step a round trip between the ranks (1-2 ms on 2 busy CPU
    cores, 3 % of a 60 ms step). So while every rank's steps are shorter than
    `STOP_CHECK_WAIT_STEP_S` the check runs beside the next step and is read at its end, and
    only about every `STOP_CHECK_EVERY_S` seconds' worth of steps checks at all: the ranks
    then stop within about that time plus one (short) step of the request. How the next
    checks go is decided from the last agreed result (it carries whether any rank's steps
    were long, and the longest mean step), applied at the same call on every rank, so the
    ranks always answer alike. Long steps wait for their own check, every step, as a stop
    grace of a few seconds needs.

    The first call tells the launcher that this rank acts on stop requests: only then does an
    interrupted caller wait `stop_grace` for the ranks before killing them.
    """
    global _stop_check_recorded
    if not _stop_check_recorded:
        _stop_check_recorded = True
        run_dir = os.environ.get(RUN_DIR_ENV)
        if run_dir:
            with contextlib.suppress(OSError):
                RunDir(Path(run_dir)).write_stop_check(get_global_rank(), _attempt())
    if not (dist.is_available() and dist.is_initialized()):
        return _stop_requested
    group = _control_group()
    assert _control is not None
    return _control[2].check(group)


def _control_group() -> Any:
    """A gloo group of all ranks for the stop check, created on first use (by every rank).

    Apart from the default group: a technique may keep its own collectives in flight on the
    default group across steps (FSDP2 prefetches), and a check interleaved with them there
    would mismatch their messages. On CPU tensors, so a GPU run pays no device sync for it.
    """
    global _control
    group = dist.group.WORLD
    if _control is None or _control[0] is not group:
        _control = (group, dist.new_group(backend="gloo"), _StopChecks())
    return _control[1]


def heartbeat(step: int) -> None:
    """Record that this rank reached `step`: call once per optimizer step, on every rank.

    The launcher's hang watchdog (`hang_timeout`) fails the launch when no rank's heartbeat
    advanced for that long, and names each rank's last step. Every call is recorded (step,
    wall time), in a few microseconds; calling again with the same step (a rank evaluating
    or saving) says the rank is alive. A failed write is ignored: a heartbeat must never stop
    training. No-op outside a `trainflow.distributed` launch.
    """
    global _heartbeat
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    with contextlib.suppress(OSError):
        if _heartbeat is None or _heartbeat[0] != run_dir:
            _heartbeat = (run_dir, RunDir(Path(run_dir)).heartbeat(get_global_rank()))
        _heartbeat[1].beat(int(step), _attempt())
