"""What a technique subflow launches: a workload, the ranks it needs, and what comes back.

Only these small pydantic values cross the process boundary; each rank builds its data and
model itself.
"""

from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ImportString, SerializeAsAny

from trainflow import runtime
from trainflow.launcher import LaunchOptions
from trainflow.strategies import build_strategy
from trainflow.strategies.config import TechniqueConfig


class Resources(BaseModel):
    """Where the ranks run."""

    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(
        default=2, ge=1, description="Ranks in total (GPUs, or CPU processes on CPU)."
    )
    gpu_type: str | None = Field(
        default=None,
        description='GPU type such as "H100"; "cpu" forces CPU ranks; empty: what exists.',
    )
    nnodes: int = Field(default=1, ge=1, description="Nodes the ranks are spread over.")
    timeout_s: float = Field(default=1800, gt=0, description="Bound on the whole training launch.")

    def launch_options(self) -> LaunchOptions:
        """The launcher's options for these resources."""
        return LaunchOptions(
            gpus=self.gpus, gpu_type=self.gpu_type, nnodes=self.nnodes, timeout=self.timeout_s
        )


class Workload(BaseModel):
    """A training function every rank runs, the model it trains, its config and its outputs.

    `train_fn(config, strategy, output_dir=..., mlflow_run_id=..., resume_from=...)` must
    return a `TrainResult`; `model_fn(config)` builds the model (the subflow builds it on the
    meta device to check the technique fits before launching).
    """

    model_config = ConfigDict(extra="forbid")

    train_fn: ImportString = Field(description="Import path module:function of the train loop.")
    model_fn: ImportString = Field(description="Import path module:function building the model.")
    config: SerializeAsAny[BaseModel] = Field(description="The workload's own config.")
    output_dir: str = Field(description="Folder for checkpoints and the exported model.")
    mlflow_run_id: str | None = Field(
        default=None, description="MLflow run rank 0 logs metrics to."
    )
    resume_from: str | None = Field(
        default=None, description="A checkpoint folder, or a folder of them (the latest is used)."
    )


class TrainResult(BaseModel):
    """What training produced: small values and URIs, never tensors."""

    technique: str = Field(description="Technique that trained the model.")
    world_size: int = Field(description="Ranks that trained it.")
    steps: int = Field(description="Optimizer steps reached.")
    metrics: dict[str, float] = Field(description="Training metrics at the last logged step.")
    history: dict[int, dict[str, float]] = Field(description="Logged metrics by step.")
    checkpoint_uri: str | None = Field(description="Last checkpoint written (file URI).")
    model_uri: str = Field(description="Consolidated plain state dict (file URI).")


def local_path(uri: str) -> Path:
    """The local path of a `file://` URI."""
    return Path(uri.removeprefix("file://"))


def check_before_launch(
    workload: Workload, technique: TechniqueConfig, resources: Resources
) -> None:
    """Fail in the caller, before any rank starts, if the technique cannot train the workload.

    Raises:
        ValueError: naming the technique field or the model that does not fit.
    """
    technique.check_world_size(resources.gpus)
    with torch.device("meta"):
        model = workload.model_fn(workload.config)
    build_strategy(technique).check_model(model)


def run_on_rank(workload: Workload, technique: TechniqueConfig) -> Any:
    """Rank entry point: open the process group, build the strategy, run the workload."""
    with runtime.process_group():
        return workload.train_fn(
            workload.config,
            build_strategy(technique),
            output_dir=workload.output_dir,
            mlflow_run_id=workload.mlflow_run_id,
            resume_from=workload.resume_from,
        )
