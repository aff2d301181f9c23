"""Config of the ~10M-parameter transformer classifier pipeline (FSDP2 by default)."""

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainflow.configs.base import PipelineConfig
from trainflow.gate import Threshold
from trainflow.paths import SafeName
from trainflow.strategies.config import FSDPConfig, OptimizerConfig, TechniqueConfig


class ModelConfig(BaseModel):
    """Transformer shape; the defaults give about 10M parameters."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    vocab_size: int = Field(default=1024, ge=2, description="Token vocabulary size.")
    seq_len: int = Field(default=32, ge=1, description="Tokens per sequence.")
    d_model: int = Field(default=256, ge=1, description="Width of the residual stream.")
    num_heads: int = Field(default=8, ge=1, description="Attention heads (must divide d_model).")
    num_layers: int = Field(default=12, ge=1, description="Transformer blocks.")
    d_ff: int = Field(default=1024, ge=1, description="Hidden width of each block's MLP.")
    num_classes: int = Field(default=4, ge=2, description="Classes to predict.")

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.d_model % self.num_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must divide model.d_model={self.d_model}"
            )
        return self


class SyntheticDataConfig(BaseModel):
    """The synthetic classification task."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_key_tokens: int = Field(default=8, ge=1, description="Key tokens per class.")
    signal: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="Share of a sequence's tokens drawn from its class's keys.",
    )
    num_eval_samples: int = Field(
        default=1024, ge=1, description="Held-out sequences for evaluation."
    )


class TrainingConfig(BaseModel):
    """Steps, batches, optimizer and cadence."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_steps: int = Field(default=60, ge=1, description="Optimizer steps.")
    global_batch_size: int = Field(
        default=16,
        ge=1,
        description="Sequences per optimizer step over all ranks and micro-batches.",
    )
    grad_accum_steps: int = Field(default=1, ge=1, description="Micro-batches per optimizer step.")
    optimizer: OptimizerConfig = Field(
        default_factory=OptimizerConfig, description="AdamW settings."
    )
    log_every: int = Field(default=5, ge=1, description="Log loss and accuracy every N steps.")
    seed: int = Field(default=0, description="Seed for the initial weights and the data.")

    def micro_batch_size(self, world_size: int) -> int:
        """Sequences per rank per micro-batch; raise if the global batch does not split."""
        split = world_size * self.grad_accum_steps
        if self.global_batch_size % split:
            raise ValueError(
                f"training.global_batch_size={self.global_batch_size} must be divisible by "
                f"{world_size} ranks x training.grad_accum_steps={self.grad_accum_steps}"
            )
        return self.global_batch_size // split


class TransformerConfig(PipelineConfig):
    """Everything the transformer pipeline needs; shown as the run form in the Prefect UI."""

    BACKGROUND_CHECKPOINTS = True  # trains in trainflow's own loop

    model: ModelConfig = Field(default_factory=ModelConfig, description="Transformer shape.")
    data: SyntheticDataConfig = Field(
        default_factory=SyntheticDataConfig, description="Synthetic task."
    )
    training: TrainingConfig = Field(
        default_factory=TrainingConfig, description="Steps, batches, optimizer."
    )
    technique: TechniqueConfig = Field(
        default_factory=FSDPConfig,
        description="Technique: ddp, fsdp or deepspeed, or a JSON object with its options, "
        'e.g. {"name": "deepspeed", "zero_stage": 3}.',
    )
    experiment_name: SafeName = Field(default="transformer", description="MLflow experiment.")
    registered_model_name: SafeName = Field(
        default="transformer",
        description="MLflow registered model to add a version to (letters, digits, ._-).",
    )
    checkpoint_every: int = Field(
        default=20,
        ge=0,
        description="Checkpoint every N optimizer steps, at the end and on a stop (Ctrl-C, "
        "SIGTERM, cancel); 0: never, and a crash restarts from step 0.",
    )
    min_eval_accuracy: float = Field(
        default=0.5, ge=0, le=1, description="Register only when held-out accuracy reaches this."
    )

    @model_validator(mode="after")
    def _check(self) -> "TransformerConfig":
        self.training.micro_batch_size(self.gpus)
        self.technique.check_world_size(self.gpus)
        keys = self.model.num_classes * self.data.num_key_tokens
        if keys > self.model.vocab_size:
            raise ValueError(
                f"model.num_classes={self.model.num_classes} x data.num_key_tokens="
                f"{self.data.num_key_tokens} = {keys} key tokens exceed model.vocab_size="
                f"{self.model.vocab_size}: each class needs key tokens of its own"
            )
        return self

    def gate(self) -> list[Threshold]:
        """Registered only when held-out accuracy reaches `min_eval_accuracy`."""
        return [Threshold("eval_accuracy", ">=", self.min_eval_accuracy, "min_eval_accuracy")]
