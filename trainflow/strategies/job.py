"""What a technique subflow launches: a workload, the ranks it needs, and what comes back.

Only these small pydantic values cross the process boundary; each rank builds its data and
model itself. The module imports no torch: the orchestrator reads it before any rank starts.
"""

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ImportString, SerializeAsAny

from trainflow.resources import Resources
from trainflow.strategies.config import TechniqueConfig, check_framework

__all__ = [
    "Resources",
    "TrainResult",
    "Workload",
    "check_before_launch",
    "local_path",
    "run_on_rank",
]


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
    framework: Literal["torch", "hf", "lightning"] = Field(
        default="torch",
        description="What applies the technique on the ranks: our loop, the Hugging Face "
        "Trainer or Lightning.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="Process-group backend; auto is nccl on GPUs, else gloo."
    )
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
    wrapped_as: str = Field(
        description="Class of the model as trained: the technique's wrapper (e.g. "
        "DistributedDataParallel, FSDPLlamaForCausalLM, DeepSpeedEngine)."
    )
    steps: int = Field(description="Optimizer steps reached.")
    metrics: dict[str, float] = Field(description="Training metrics (train_*) at the end.")
    history: dict[int, dict[str, float]] = Field(description="Logged metrics by step.")
    checkpoint_uri: str | None = Field(description="Last checkpoint written (file URI).")
    model_uri: str = Field(description="The trained model: a file or folder URI.")


def local_path(uri: str) -> Path:
    """The local path of a `file://` URI."""
    return Path(uri.removeprefix("file://"))


def check_before_launch(
    workload: Workload, technique: TechniqueConfig, resources: Resources
) -> None:
    """Fail in the caller, before any rank starts, if the technique cannot train the workload.

    Raises:
        ValueError: naming the technique field, the framework, or the model that does not fit.
    """
    import torch

    from trainflow.strategies import build_strategy

    plan = resources.launch_plan()
    check_framework(technique, workload.framework, device_type=plan.device)
    technique.check_world_size(resources.gpus)
    with torch.device("meta"):
        model = workload.model_fn(workload.config)
    build_strategy(technique).check_model(model)


def run_on_rank(workload: Workload, technique: TechniqueConfig) -> Any:
    """Rank entry point: open the process group, build the strategy, run the workload."""
    from trainflow import runtime
    from trainflow.strategies import build_strategy

    backend = None if workload.backend == "auto" else workload.backend
    with runtime.process_group(backend):
        return workload.train_fn(
            workload.config,
            build_strategy(technique),
            output_dir=workload.output_dir,
            mlflow_run_id=workload.mlflow_run_id,
            resume_from=workload.resume_from,
        )
