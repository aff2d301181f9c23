"""Rank discipline in one place: who am I, which device is mine, and a process group pair.

Every helper reads the torchrun/torch-elastic environment, so it gives the same answer under
`trainflow.distributed`, `torchrun`, Ray or a plain `python` process (rank 0 of 1).
"""

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist


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


def init_process_group(backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Initialise the default process group from the launcher's environment.

    On CUDA the rank's device is bound to `LOCAL_RANK` first. When the launcher restarts
    workers (`max_restarts > 0`) the agent's store is reused across attempts, so each attempt
    gets its own key prefix: a restarted rank never reads a dead rank's address.
    """
    backend = backend or default_backend()
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
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(backend: str | None = None) -> Iterator[None]:
    """`init_process_group` and `destroy_process_group` as a pair, cleanup in `finally`."""
    init_process_group(backend)
    try:
        yield
    finally:
        destroy_process_group()
