"""Where a launch's ranks run: the plan a GPU request resolves to on this machine or a cluster.

`resolve_resources` turns a request (GPU count, GPU type, nodes) into a `LaunchPlan` before
anything starts. It is a pure function of the request and a `GpuInventory`, so the GPU branches
are testable on a machine without GPUs by passing an inventory in. It imports no torch.
"""

import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

CPU_FALLBACK_ENV = "TRAINFLOW_CPU_FALLBACK"


class ResourceError(ValueError):
    """The requested GPUs do not exist on this machine (raised before any process starts)."""


@dataclass(frozen=True)
class GpuInventory:
    """The GPUs visible on this node, by name (e.g. `"NVIDIA H100 80GB HBM3"`)."""

    names: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.names)

    def describe(self) -> str:
        if not self.names:
            return "no GPU"
        counts: dict[str, int] = {}
        for name in self.names:
            counts[name] = counts.get(name, 0) + 1
        return ", ".join(f"{n}x {name}" for name, n in counts.items())

    @classmethod
    def detect(cls) -> "GpuInventory":
        """GPUs visible to this process, without creating a CUDA context in the caller.

        `nvidia-smi` gives names without touching CUDA; torch's NVML-based count is the fallback.
        `CUDA_VISIBLE_DEVICES` is honoured either way.
        """
        rows = query_gpus("name")
        if rows is None:
            import torch

            return cls(("unknown GPU",) * torch.cuda.device_count())
        return cls(tuple(name for (name,) in rows))


def query_gpus(*fields: str) -> list[list[str]] | None:
    """`nvidia-smi --query-gpu=FIELDS` for the GPUs this process may use, without touching
    CUDA: one list of values per GPU, `CUDA_VISIBLE_DEVICES` honoured (units left out, so
    `memory.total` is in MiB). None without `nvidia-smi`, or when it fails or lists no GPU.
    """
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    rows = [
        [value.strip() for value in line.rsplit(",", len(fields) - 1)]
        for line in out.splitlines()
        if line.strip()
    ]
    if not rows:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        picked = [v.strip() for v in visible.split(",") if v.strip()]
        rows = [rows[int(i)] for i in picked if i.isdigit() and int(i) < len(rows)]
    return rows


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch will use: the device kind and how many ranks on each node."""

    device: Literal["cuda", "cpu"]
    nproc_per_node: int
    nnodes: int
    gpu_name: str | None = None
    # With an elastic node range, the fewest nodes a launch may run on (`nnodes` is the most).
    min_nodes: int | None = None
    # The Ray cluster, or the remote deployment, that places the nodes (their GPUs and cores
    # are its, not this machine's).
    cluster: str | None = None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


# CPU ranks beyond this many per core are refused before launch: each rank is a full process
# with its own model copy, and past it a run spends its time switching, not training.
MAX_CPU_RANKS_PER_CORE = 4


def check_cpu_oversubscription(plan: "LaunchPlan", cores: int | None = None) -> None:
    """Warn when CPU ranks outnumber this node's cores; refuse far beyond that.

    Args:
        plan: A resolved launch plan (only CPU plans are checked).
        cores: Cores on this node; `os.cpu_count()` when not given.

    Raises:
        ResourceError: more than `MAX_CPU_RANKS_PER_CORE` ranks per core.
    """
    if plan.device != "cpu" or plan.cluster:
        return  # a cluster reserves one CPU per CPU rank itself
    cores = cores or os.cpu_count() or 1
    limit = MAX_CPU_RANKS_PER_CORE * cores
    if plan.nproc_per_node > limit:
        raise ResourceError(
            f"gpus={plan.world_size} would start {plan.nproc_per_node} CPU ranks on a node with "
            f"{cores} cores; at most {limit} ({MAX_CPU_RANKS_PER_CORE} per core) are allowed. "
            "Ask for fewer ranks, or for GPUs."
        )
    if plan.nproc_per_node > cores:
        logger.warning(
            "%d CPU ranks on %d cores: ranks will compete for cores (correct, but slow)",
            plan.nproc_per_node,
            cores,
        )


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[\s\-_/]+", name.upper()) if t]


def gpu_name_matches(requested: str, actual: str) -> bool:
    """Whole-word match: "A10" matches "NVIDIA A10" but not "NVIDIA A100-SXM4-80GB"."""
    want, have = _tokens(requested), _tokens(actual)
    if not want:
        return False
    return any(have[i : i + len(want)] == want for i in range(len(have) - len(want) + 1))


def node_range(nnodes: object) -> tuple[int, int]:
    """`(min, max)` nodes of `nnodes`: a whole number, or an elastic range such as "2:4".

    With a range, a launch starts on as many nodes as the cluster can give within it, and
    re-forms on what is left (or added) after a node is lost. `gpus` counts the ranks at the
    largest size: each node runs `gpus // max` ranks.

    Raises:
        ResourceError: anything else, naming `nnodes`.
    """
    if isinstance(nnodes, int) and not isinstance(nnodes, bool) and nnodes >= 1:
        return nnodes, nnodes
    if isinstance(nnodes, str):
        text = nnodes.strip()
        if text.isdigit() and int(text) >= 1:
            return int(text), int(text)
        low, sep, high = text.partition(":")
        if sep and low.strip().isdigit() and high.strip().isdigit():
            lo, hi = int(low), int(high)
            if 1 <= lo <= hi:
                return lo, hi
    raise ResourceError(
        f"nnodes must be a positive integer or a range 'min:max' with 1 <= min <= max, "
        f"got {nnodes!r}"
    )


RAY_ADDRESS_ENV = "RAY_ADDRESS"


def ray_cluster_address(nnodes: int | str, ray_address: str | None = None) -> str | None:
    """The Ray cluster that places a launch's nodes, if any.

    `ray_address` when given (even for one node); else `RAY_ADDRESS` for launches of more than
    one node. None: the launch runs on this machine (or, over several nodes, joins a rendezvous
    set by hand).
    """
    if ray_address:
        return ray_address
    if node_range(nnodes)[1] > 1:
        return os.environ.get(RAY_ADDRESS_ENV) or None
    return None


def plan_launch(
    gpus: int, gpu_type: str | None, nnodes: int | str = 1, ray_address: str | None = None
) -> LaunchPlan:
    """The plan a launch follows: on a Ray cluster's nodes when one places them (this machine's
    GPUs do not matter), else `resolve_resources` on this machine."""
    address = ray_cluster_address(nnodes, ray_address)
    if address is None:
        return resolve_resources(gpus, gpu_type, nnodes)
    return cluster_plan(gpus, gpu_type, nnodes, address)


def cluster_plan(gpus: int, gpu_type: str | None, nnodes: int | str, address: str) -> LaunchPlan:
    """The plan of a launch a cluster places, at its largest size: CPU ranks for `gpu_type`
    "cpu" or none, else GPUs the cluster's nodes must have (Ray checks when it places them)."""
    low, high = node_range(nnodes)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ResourceError(f"gpus must be a positive integer, got {gpus!r}")
    if gpus % high:
        raise ResourceError(
            f"gpus={gpus} does not divide evenly across nnodes={high}: "
            "each node runs gpus // nnodes ranks"
        )
    cpu = gpu_type is None or gpu_type.strip().lower() == "cpu"
    return LaunchPlan("cpu" if cpu else "cuda", gpus // high, high, min_nodes=low, cluster=address)


def resolve_resources(
    gpus: int,
    gpu_type: str | None,
    nnodes: int | str = 1,
    inventory: GpuInventory | None = None,
) -> LaunchPlan:
    """Turn `gpus`/`gpu_type`/`nnodes` into a launch plan, or fail with a clear error.

    Args:
        gpus: Total number of ranks across all nodes (one GPU each when on GPUs).
        gpu_type: None for "whatever this machine has", "cpu" to force CPU ranks, or a GPU
            name such as "H100" that must match the GPUs present.
        nnodes: Number of nodes, or an elastic range "min:max" (the plan is for `max`);
            `gpus` must divide evenly across them.
        inventory: GPUs on this node; detected when not given.

    Raises:
        ResourceError: on a bad count, a GPU type that is not present (unless
            TRAINFLOW_CPU_FALLBACK=1), or more ranks per node than GPUs.
    """
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ResourceError(f"gpus must be a positive integer, got {gpus!r}")
    min_nodes, nnodes = node_range(nnodes)
    if gpus % nnodes:
        raise ResourceError(
            f"gpus={gpus} does not divide evenly across nnodes={nnodes}: "
            "each node runs gpus // nnodes ranks"
        )
    per_node = gpus // nnodes
    if gpu_type is not None and gpu_type.strip().lower() == "cpu":
        return LaunchPlan("cpu", per_node, nnodes, min_nodes=min_nodes)

    inventory = inventory if inventory is not None else GpuInventory.detect()
    if gpu_type is None:
        if inventory.count == 0:
            return LaunchPlan("cpu", per_node, nnodes, min_nodes=min_nodes)
        matching = inventory.names
    else:
        matching = tuple(n for n in inventory.names if gpu_name_matches(gpu_type, n))
        if not matching:
            message = (
                f"gpu_type={gpu_type!r} requested, but this machine has {inventory.describe()}"
            )
            if os.environ.get(CPU_FALLBACK_ENV) == "1":
                logger.warning(
                    "%s; %s=1, so running %d CPU ranks", message, CPU_FALLBACK_ENV, per_node
                )
                return LaunchPlan("cpu", per_node, nnodes, min_nodes=min_nodes)
            raise ResourceError(
                f"{message}. Set gpu_type=None to use what is present, gpu_type='cpu' for CPU "
                f"ranks, or {CPU_FALLBACK_ENV}=1 to fall back to CPU ranks with a warning."
            )
    if per_node > len(matching):
        raise ResourceError(
            f"gpus={gpus} over nnodes={nnodes} needs {per_node} GPUs per node"
            + (f" of type {gpu_type!r}" if gpu_type else "")
            + f", but this machine has {inventory.describe()}"
        )
    return LaunchPlan("cuda", per_node, nnodes, gpu_name=matching[0], min_nodes=min_nodes)
