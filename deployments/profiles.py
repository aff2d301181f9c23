"""Hardware profiles: which work pool and job variables run a pipeline at a given size.

A pipeline's `gpus`, `gpu_type` and `nnodes` pick the profile before the run starts, so the
flow run lands on machines that have the GPUs it asks for:

- CPU ranks (`gpu_type` "cpu", or none given) -> the `cpu-local` process pool;
- a GPU type -> the `k8s-gpu` Kubernetes pool, with a GPU resource request per node and a
  node selector on the GPU product label (`deployments/k8s-gpu-job-template.json`).
"""

from dataclasses import dataclass, field
from typing import Any

CPU_POOL = "cpu-local"
GPU_POOL = "k8s-gpu"
# Node labels as set by NVIDIA's GPU feature discovery (`nvidia.com/gpu.product`).
GPU_PRODUCTS = {
    "H100": "NVIDIA-H100-80GB-HBM3",
    "H200": "NVIDIA-H200",
    "A100": "NVIDIA-A100-SXM4-80GB",
    "A10": "NVIDIA-A10G",
    "L4": "NVIDIA-L4",
}


class ProfileError(ValueError):
    """No profile can run the requested size (raised before any run is created)."""


@dataclass(frozen=True)
class Profile:
    """Where a run goes: the deployment suffix, the work pool and its job variables."""

    deployment: str
    work_pool: str
    job_variables: dict[str, Any] = field(default_factory=dict)


def requested_size(config: dict[str, Any]) -> tuple[int, str | None, int]:
    """`(gpus, gpu_type, nnodes)` of a pipeline config, flat or under `resources`."""
    section = config.get("resources", config)
    return (
        int(section.get("gpus", 2)),
        section.get("gpu_type"),
        int(section.get("nnodes", 1)),
    )


def select_profile(gpus: int, gpu_type: str | None, nnodes: int = 1) -> Profile:
    """Pick the profile for a run of `gpus` ranks of `gpu_type` over `nnodes` nodes.

    Raises:
        ProfileError: unknown GPU type, counts that do not divide, or a multi-node request
            (no multi-node work pool is defined yet).
    """
    if gpus < 1 or nnodes < 1:
        raise ProfileError(f"gpus and nnodes must be >= 1, got gpus={gpus}, nnodes={nnodes}")
    if gpus % nnodes:
        raise ProfileError(f"gpus={gpus} does not divide evenly across nnodes={nnodes}")
    if nnodes > 1:
        raise ProfileError(
            f"nnodes={nnodes}: deployments run on one node; launch multi-node jobs with "
            "TRAINFLOW_RDZV_ENDPOINT on each node (see README, 'Several nodes')"
        )
    if gpu_type is None or gpu_type.lower() == "cpu":
        return Profile("cpu-local", CPU_POOL)
    key = gpu_type.upper()
    if key not in GPU_PRODUCTS:
        raise ProfileError(
            f"gpu_type={gpu_type!r} has no hardware profile; known: {', '.join(GPU_PRODUCTS)}"
        )
    return Profile(
        key.lower(),
        GPU_POOL,
        {
            "gpus_per_node": gpus // nnodes,
            "node_selector": {"nvidia.com/gpu.product": GPU_PRODUCTS[key]},
        },
    )
