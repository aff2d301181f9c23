"""Config of the simple MLP regression pipeline (DDP by default)."""

from typing import Literal

from pydantic import Field, model_validator

from trainflow.configs.base import PipelineConfig
from trainflow.gate import Threshold
from trainflow.paths import SafeName
from trainflow.strategies.config import DDPConfig, OptimizerConfig


class MLPConfig(PipelineConfig):
    """Everything the MLP pipeline needs; shown as the run form in the Prefect UI."""

    BACKGROUND_CHECKPOINTS = True  # trains in trainflow's own loop

    num_features: int = Field(10, ge=1, description="Input features of the synthetic data.")
    hidden_size: int = Field(64, ge=1, description="Width of the two hidden layers.")
    num_train_samples: int = Field(8192, ge=16, description="Synthetic training rows.")
    num_eval_samples: int = Field(2048, ge=16, description="Held-out rows for evaluation.")
    noise_std: float = Field(0.05, ge=0, description="Gaussian noise added to targets.")
    batch_size: int = Field(64, ge=1, description="Rows per step on each rank.")
    num_epochs: int = Field(5, ge=1, description="Passes over the training rows.")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many steps (overrides num_epochs when sooner)."
    )
    learning_rate: float = Field(3e-3, gt=0, description="Adam learning rate.")
    seed: int = Field(0, description="Seed for data order, sampling and initial weights.")
    log_every: int = Field(25, ge=1, description="Log the training loss every N steps.")
    log_samples: bool = Field(
        False,
        description="Record the row ids each rank trained on at each step "
        "(samples/rank_N.jsonl in the run's output folder), an audit trail of the data order.",
    )
    experiment_name: SafeName = Field("mlp", description="MLflow experiment.")
    registered_model_name: SafeName = Field(
        "mlp", description="MLflow registered model to add a version to (letters, digits, ._-)."
    )
    min_r2: float = Field(
        0.5, description="Register only when held-out R^2 reaches this (the model learned)."
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Process-group backend; auto is nccl on GPUs and gloo on CPU."
    )

    @model_validator(mode="after")
    def _check(self) -> "MLPConfig":
        if self.batch_size * self.gpus > self.num_train_samples:
            raise ValueError(
                f"batch_size={self.batch_size} x gpus={self.gpus} exceeds "
                f"num_train_samples={self.num_train_samples}: no full step fits"
            )
        if self.backend == "nccl" and (self.gpu_type or "").lower() == "cpu":
            raise ValueError("backend='nccl' needs GPU ranks, but gpu_type='cpu'")
        return self

    @property
    def technique(self) -> DDPConfig:
        """The catalogue's MLP example trains with DDP (through the shared loop)."""
        return DDPConfig()

    @property
    def optimizer(self) -> OptimizerConfig:
        """Adam is AdamW without weight decay."""
        return OptimizerConfig(learning_rate=self.learning_rate)

    def gate(self) -> list[Threshold]:
        """Registered only when held-out R^2 reaches `min_r2`."""
        return [Threshold("eval_r2", ">=", self.min_r2, "min_r2")]
