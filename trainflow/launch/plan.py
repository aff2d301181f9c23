"""Where a launch's ranks run: the plan a GPU request resolves to on this machine or a cluster.

`resolve_resources` turns a request (GPU count, GPU type, nodes) into a `LaunchPlan` before
anything starts. It is a pure function of the request and a `GpuInventory`, so the GPU branches
are testable on a machine without GPUs by passing an inventory in. It imports no torch.

`place` comes first: it maps a request by accelerator type (`ACCELERATOR_TYPES`: "GPU_8xH100"
is nodes of 8 H100s) or by GPU name, with or without a count, to those three.
"""

import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeGuard

logger = logging.getLogger(__name__)

CPU_FALLBACK_ENV = "TRAINFLOW_CPU_FALLBACK"


class ResourceError(ValueError):
    """A request for ranks that cannot be met: a bad count or accelerator type, or GPUs this
    machine does not have (raised before any process starts, naming the field)."""


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
# Set to a number of CPU ranks per node to allow up to that many, whatever the cores.
MAX_CPU_RANKS_ENV = "TRAINFLOW_MAX_CPU_RANKS"


def check_cpu_oversubscription(plan: "LaunchPlan", cores: int | None = None) -> None:
    """Warn when CPU ranks outnumber this node's cores; refuse far beyond that.

    The limit is `MAX_CPU_RANKS_PER_CORE` per core, or `TRAINFLOW_MAX_CPU_RANKS` when set.

    Args:
        plan: A resolved launch plan (only CPU plans are checked).
        cores: Cores on this node; `os.cpu_count()` when not given.

    Raises:
        ResourceError: more CPU ranks per node than the limit, naming both figures.
    """
    if plan.device != "cpu" or plan.cluster:
        return  # a cluster reserves one CPU per CPU rank itself
    cores = cores or os.cpu_count() or 1
    limit = MAX_CPU_RANKS_PER_CORE * cores
    why = f"{MAX_CPU_RANKS_PER_CORE} per core"
    override = os.environ.get(MAX_CPU_RANKS_ENV, "").strip()
    if override:
        if not override.isdigit() or int(override) < 1:
            raise ResourceError(f"{MAX_CPU_RANKS_ENV}={override!r}: give a positive number")
        limit, why = int(override), f"{MAX_CPU_RANKS_ENV}={override}"
    if plan.nproc_per_node > limit:
        raise ResourceError(
            f"gpus={plan.world_size} would start {plan.nproc_per_node} CPU ranks on a node with "
            f"{cores} cores; at most {limit} ({why}) are allowed. Ask for fewer ranks, or for "
            f"GPUs, or set {MAX_CPU_RANKS_ENV} to the most CPU ranks a node may run."
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


# GPU models a `gpu_type` may name, as whole words of the device's name ("H100" in "NVIDIA H100
# 80GB HBM3"); an accelerator type ("GPU_8xH100") names one of them with its node size.
KNOWN_GPUS = (
    "A10",
    "A10G",
    "A100",
    "A800",
    "B100",
    "B200",
    "B300",
    "GB200",
    "GB300",
    "GH200",
    "H100",
    "H200",
    "H800",
    "L4",
    "L40",
    "L40S",
    "T4",
    "V100",
)
# Workstation and consumer boards, named by family and number ("RTX 4090", "RTX A6000").
_BOARD_NAME = re.compile(r"(RTX|GTX|QUADRO|TESLA)[\s_-]*[A-Z]*\d{2,4}\w*", re.IGNORECASE)


def known_gpu_type(gpu_type: str | None, field: str = "gpu_type") -> str | None:
    """`gpu_type` as the launch matches it: None, "cpu", or a GPU name.

    An accelerator type ("GPU_8xH100") stands for its GPU ("H100"); a GPU name is kept as
    given when it names a known GPU ("H100", "NVIDIA A100-SXM4-80GB", "RTX 4090").

    Raises:
        ResourceError: an unknown name ("banana"), naming `field` and listing the known ones.
    """
    if gpu_type is None:
        return None
    name = gpu_type.strip()
    if name.lower() == "cpu":
        return "cpu"
    if is_accelerator_name(name):
        return accelerator_type(name, field).gpu_type
    if any(gpu_name_matches(known, name) for known in KNOWN_GPUS) or _BOARD_NAME.search(name):
        return name
    raise ResourceError(
        f"{field}={gpu_type!r} is not a GPU type trainflow knows; known: 'cpu', "
        f"{', '.join(KNOWN_GPUS)} (or a board such as 'RTX 4090'), and the accelerator types "
        f"{', '.join(ACCELERATOR_TYPES)}"
    )


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
    gpu_type = known_gpu_type(gpu_type)
    cpu = gpu_type is None or gpu_type == "cpu"
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
    gpu_type = known_gpu_type(gpu_type)
    if gpu_type == "cpu":
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


@dataclass(frozen=True)
class AcceleratorType:
    """A kind of node a launch may ask for by name: its GPU and how many each node has."""

    name: str
    gpu_type: str
    per_node: int


ACCELERATOR_TYPES = {
    kind.name: kind
    for kind in (
        AcceleratorType("GPU_1xA10", "A10", 1),
        AcceleratorType("GPU_1xH100", "H100", 1),
        AcceleratorType("GPU_8xH100", "H100", 8),
        AcceleratorType("GPU_8xB300", "B300", 8),
    )
}

# Ranks a request that gives no count runs on a machine without GPUs (CPU ranks, with gloo).
DEFAULT_CPU_RANKS = 1


def is_accelerator_name(value: object) -> TypeGuard[str]:
    """Whether `value` is spelled as an accelerator type ("GPU_8xH100"), known or not, rather
    than as a GPU name ("H100") or "cpu"."""
    return isinstance(value, str) and re.fullmatch(r"GPU_\d+x\w+", value.strip(), re.I) is not None


def accelerator_type(name: str, field: str = "accelerator_type") -> AcceleratorType:
    """The accelerator type called `name`.

    Raises:
        ResourceError: an unknown name, naming `field` and listing the known ones.
    """
    kind = ACCELERATOR_TYPES.get(name)
    if kind is None:
        raise ResourceError(
            f"{field}={name!r} is not an accelerator type; valid types: "
            f"{', '.join(ACCELERATOR_TYPES)} (or a GPU name such as 'H100', or 'cpu', as "
            "gpu_type)"
        )
    return kind


def check_count(name: str, count: object) -> int:
    """`count` as a rank count, or a `ResourceError` naming the field it was given as."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ResourceError(f"{name} must be a positive integer, got {count!r}")
    return count


def accelerator_nodes(count: int, kind: AcceleratorType, name: str = "num_accelerators") -> int:
    """How many nodes of `kind` run `count` ranks: one node for up to a node's GPUs, else whole
    nodes.

    Raises:
        ResourceError: a count the shape cannot hold (more than a node, not a multiple of it).
    """
    if count <= kind.per_node:
        return 1
    if count % kind.per_node:
        raise ResourceError(
            f"{name}={count} does not fit accelerator_type={kind.name!r} ({kind.per_node} "
            f"{kind.gpu_type} per node): ask for at most {kind.per_node} (part of one node) or "
            f"a multiple of {kind.per_node} (whole nodes)"
        )
    return count // kind.per_node


def default_count(
    kind: AcceleratorType | None, remote: bool, inventory: GpuInventory | None = None
) -> int:
    """The rank count of a request that gives none: every GPU attached to this machine (at
    most one node of `kind`), `DEFAULT_CPU_RANKS` without GPUs; a remote call, one node of
    `kind` (this machine's GPUs say nothing of the remote one's).

    Raises:
        ResourceError: a remote call with neither a count nor an accelerator type.
    """
    if remote:
        if kind is None:
            raise ResourceError(
                "remote=True with num_accelerators=None needs an accelerator_type (a node of "
                f"it is the default: one of {', '.join(ACCELERATOR_TYPES)}) or a count"
            )
        return kind.per_node
    attached = (inventory if inventory is not None else GpuInventory.detect()).count
    if attached == 0:
        return DEFAULT_CPU_RANKS
    return min(attached, kind.per_node) if kind else attached


class Placement(NamedTuple):
    """A request in the launch options' terms: total ranks, GPU type, nodes."""

    gpus: int
    gpu_type: str | None
    nnodes: int | str


def place(
    count: int | None,
    kind_or_gpu: str | None,
    nnodes: int | str | None = None,
    remote: bool = False,
    count_name: str = "num_accelerators",
    inventory: GpuInventory | None = None,
) -> Placement:
    """Map a request to ranks, GPU type and nodes.

    Args:
        count: Total ranks; None: `default_count`.
        kind_or_gpu: An accelerator type ("GPU_8xH100": its GPU, and nodes of its size), or
            what `resolve_resources` takes as `gpu_type` (None, "cpu", a GPU name).
        nnodes: Nodes, or an elastic range; None: one, or what the accelerator type implies
            (given as well, it must agree).
        remote: Whether the ranks run on a remote deployment (the default count differs).
        count_name: The field `count` was given as, for messages.
        inventory: GPUs on this node; detected when needed and not given.

    Raises:
        ResourceError: an unknown accelerator type, a bad count or one the type cannot hold,
            or `nnodes` that disagrees with the type; each names the fields.
    """
    kind = accelerator_type(kind_or_gpu.strip()) if is_accelerator_name(kind_or_gpu) else None
    if count is None:
        count = default_count(kind, remote, inventory)
    count = check_count(count_name, count)
    if kind is None:
        known_gpu_type(kind_or_gpu)  # "banana" fails here, with the known names
        return Placement(count, kind_or_gpu, 1 if nnodes is None else nnodes)
    nodes = accelerator_nodes(count, kind, count_name)
    if nnodes is not None and node_range(nnodes) != (nodes, nodes):
        raise ResourceError(
            f"nnodes={nnodes!r} disagrees with accelerator_type={kind.name!r}: {count_name}="
            f"{count} runs on {nodes} node(s) of {kind.per_node}; leave nnodes out"
        )
    return Placement(count, kind.gpu_type, nodes)
