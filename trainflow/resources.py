"""The one request model for where ranks run (`Resources`).

`Resources` (GPU count, GPU type, nodes, timeout) is what pipeline configs, deployment profiles,
technique subflows and the launcher all read; pipeline configs inherit its fields, so every
pipeline takes `--gpus`, `--gpu-type`, `--nnodes` and `--timeout-s` alike. It imports no torch.
The plan a request resolves to is `trainflow.launch.plan`'s; `launch_options` gives the
launcher's options for it.
"""

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainflow.launch.plan import (
    LaunchPlan,
    ResourceError,
    known_gpu_type,
    node_range,
    plan_launch,
)
from trainflow.launch.spec import LaunchOptions


class Resources(BaseModel):
    """Where the ranks run (GPU count and type, nodes) and how a launch is bounded and recovered.

    Pipeline configs subclass it, so its fields are top-level options of every pipeline.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    gpus: int = Field(default=2, ge=1, description="Ranks in total (GPUs, or CPU processes).")
    gpu_type: str | None = Field(
        default=None,
        description='GPU type such as "H100"; "cpu" forces CPU ranks; empty: what exists.',
    )
    nnodes: int | str = Field(
        default=1,
        description='Nodes the ranks are spread over, or an elastic range such as "2:4" (on a '
        "Ray cluster: starts on what it can give within the range).",
    )
    ray_address: str | None = Field(
        default=None,
        description="Ray cluster to place multi-node launches on (else RAY_ADDRESS); none and "
        "no RAY_ADDRESS: nodes join through TRAINFLOW_RDZV_ENDPOINT.",
    )
    timeout_s: float = Field(default=3600, gt=0, description="Bound on the whole training launch.")
    max_restarts: int = Field(
        default=0,
        ge=0,
        description="Times torch elastic restarts the ranks after one dies; they continue from "
        "the last checkpoint.",
    )
    retries: int = Field(
        default=1,
        ge=0,
        description="Times training is relaunched after a failure a relaunch can fix (a killed "
        "rank, a lost peer, a hang, a timeout, a preemption), from the last checkpoint; never "
        "after an error in the code or the config.",
    )
    collective_timeout_s: float = Field(
        default=600,
        gt=0,
        description="A rank waiting this long for its peers in a collective fails the launch.",
    )
    hang_timeout_s: float | None = Field(
        default=1800,
        gt=0,
        description="Fail the launch, naming the ranks and where they are stuck, when no rank "
        "finished a step for this long. None: no watchdog.",
    )
    stop_grace_s: float = Field(
        default=30,
        gt=0,
        description="On Ctrl-C, SIGTERM or a cancel, time the ranks get to write a final "
        "checkpoint before they are killed.",
    )

    @field_validator("nnodes", mode="before")
    @classmethod
    def _check_nnodes(cls, value: object) -> int | str:
        try:
            low, high = node_range(value)
        except ResourceError as exc:
            raise ValueError(str(exc)) from None
        return high if low == high else f"{low}:{high}"

    @field_validator("gpu_type")
    @classmethod
    def _check_gpu_type(cls, value: str | None) -> str | None:
        try:
            known_gpu_type(value)
        except ResourceError as exc:
            raise ValueError(str(exc)) from None
        return value

    def launch_plan(self) -> LaunchPlan:
        """Where these resources will run (`plan_launch`), checked before anything starts."""
        return plan_launch(self.gpus, self.gpu_type, self.nnodes, self.ray_address)

    @property
    def resources(self) -> "Resources":
        """Only the placement fields (of a pipeline config that inherits them)."""
        return Resources.model_validate(self.model_dump(include=set(Resources.model_fields)))

    def launch_options(self, stop_file: str | None = None) -> LaunchOptions:
        """The launcher's options for these resources (`stop_file`: see `LaunchOptions`)."""
        return LaunchOptions(
            gpus=self.gpus,
            gpu_type=self.gpu_type,
            nnodes=self.nnodes,
            ray_address=self.ray_address,
            timeout=self.timeout_s,
            max_restarts=self.max_restarts,
            collective_timeout=self.collective_timeout_s,
            hang_timeout=self.hang_timeout_s,
            stop_grace=self.stop_grace_s,
            stop_file=stop_file,
        )
