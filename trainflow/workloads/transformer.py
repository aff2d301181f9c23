"""Sequence classification with a ~10M-parameter transformer, under any technique.

`train` runs on every rank with the strategy the subflow chose; `evaluate` runs wherever the
exported weights are. The data is synthetic and generated per step from the seed, so every
rank (and a resumed run, on any world size) sees exactly its slice of the same global batch.
Each class has a few key tokens; a sequence of that class draws a share `signal` of its
tokens from them and the rest uniformly.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from trainflow import checkpoint, runtime
from trainflow.models.transformer import TransformerClassifier
from trainflow.paths import SafeName
from trainflow.strategies import FSDPConfig, OptimizerConfig, Strategy, TechniqueConfig
from trainflow.strategies.job import Resources, TrainResult
from trainflow.strategies.loop import Batch, Schedule, fit
from trainflow.tracking import metrics_sink

# The classes' key tokens come from a fixed seed: training and held-out data always agree.
_TRUTH_SEED = 4321


class ModelConfig(BaseModel):
    """Transformer shape; the defaults give about 10M parameters."""

    model_config = ConfigDict(extra="forbid")

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

    model_config = ConfigDict(extra="forbid")

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

    model_config = ConfigDict(extra="forbid")

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
    checkpoint_every: int = Field(
        default=20, ge=0, description="Checkpoint every N steps and at the end; 0 disables."
    )
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


class TransformerConfig(BaseModel):
    """Everything the transformer pipeline needs; shown as the run form in the Prefect UI."""

    model_config = ConfigDict(extra="forbid")

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
    resources: Resources = Field(default_factory=Resources, description="Ranks, where they run.")
    experiment_name: SafeName = Field(default="transformer", description="MLflow experiment.")
    registered_model_name: SafeName = Field(
        default="transformer",
        description="MLflow registered model to add a version to (letters, digits, ._-).",
    )
    min_eval_accuracy: float = Field(
        default=0.5, ge=0, le=1, description="Register only when held-out accuracy reaches this."
    )

    @model_validator(mode="after")
    def _check(self) -> "TransformerConfig":
        self.training.micro_batch_size(self.resources.gpus)
        self.technique.check_world_size(self.resources.gpus)
        return self


def build_model(config: TransformerConfig) -> TransformerClassifier:
    """The transformer described by `config.model`, freshly initialised."""
    m = config.model
    return TransformerClassifier(
        m.vocab_size, m.seq_len, m.d_model, m.num_heads, m.num_layers, m.d_ff, m.num_classes
    )


def make_samples(config: TransformerConfig, num_samples: int, seed: int) -> tuple[Tensor, Tensor]:
    """`num_samples` (tokens, label) pairs, deterministic in `seed`."""
    m, d = config.model, config.data
    truth = torch.Generator().manual_seed(_TRUTH_SEED)
    keys = torch.randperm(m.vocab_size, generator=truth)[: m.num_classes * d.num_key_tokens]
    keys = keys.view(m.num_classes, d.num_key_tokens)
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(m.num_classes, (num_samples,), generator=gen)
    tokens = torch.randint(m.vocab_size, (num_samples, m.seq_len), generator=gen)
    key_pick = torch.randint(d.num_key_tokens, (num_samples, m.seq_len), generator=gen)
    keyed = torch.gather(keys[labels], 1, key_pick)
    use_key = torch.rand(num_samples, m.seq_len, generator=gen) < d.signal
    return torch.where(use_key, keyed, tokens), labels


def global_batch(config: TransformerConfig, step: int) -> tuple[Tensor, Tensor]:
    """The whole batch of `step` (1-based), the same on every rank and world size."""
    seed = config.training.seed * 1_000_003 + step
    return make_samples(config, config.training.global_batch_size, seed)


def micro_batches(config: TransformerConfig, step: int, rank: int, world_size: int) -> list[Batch]:
    """This rank's contiguous slice of the global batch, split into micro-batches."""
    size = config.training.micro_batch_size(world_size)
    tokens, labels = global_batch(config, step)
    per_rank = size * config.training.grad_accum_steps
    start = rank * per_rank
    return [
        (tokens[i : i + size], labels[i : i + size]) for i in range(start, start + per_rank, size)
    ]


def compute(model: nn.Module, batch: Batch) -> dict[str, Tensor]:
    """Cross-entropy loss and accuracy of one micro-batch."""
    tokens, labels = batch
    logits = model(tokens).float()
    accuracy = (logits.argmax(dim=-1) == labels).float().mean()
    return {"loss": F.cross_entropy(logits, labels), "accuracy": accuracy}


def wrap_model(config: TransformerConfig, strategy: Strategy) -> None:
    """Build the seeded model and hand it, with its optimizer, to `strategy` on this rank."""
    t = config.training
    torch.manual_seed(t.seed)
    strategy.wrap(
        build_model(config),
        t.optimizer,
        micro_batch_size=t.micro_batch_size(runtime.get_world_size()),
        grad_accum_steps=t.grad_accum_steps,
    )


def train(
    config: TransformerConfig,
    strategy: Strategy,
    *,
    output_dir: str,
    mlflow_run_id: str | None = None,
    resume_from: str | None = None,
) -> TrainResult:
    """Train on this rank with `strategy`; checkpoint, then export the consolidated model."""
    rank, world = runtime.get_global_rank(), runtime.get_world_size()
    t = config.training
    wrap_model(config, strategy)
    start = 0
    if (resume := checkpoint.resolve(resume_from)) is not None:
        start = strategy.load(resume)
        runtime.print0(f"resumed from {resume} at step {start}")
    fitted = fit(
        strategy,
        lambda step: micro_batches(config, step, rank, world),
        compute,
        Schedule(t.num_steps, t.log_every, t.checkpoint_every),
        metrics_sink(mlflow_run_id, runtime.is_rank_zero()),
        Path(output_dir) / "checkpoints",
        start_step=start,
    )
    model_path = Path(output_dir).resolve() / "model.pt"
    strategy.export(model_path)
    last = fitted.last_checkpoint
    return TrainResult(
        technique=strategy.name,
        world_size=world,
        steps=fitted.steps,
        metrics=fitted.history[max(fitted.history)] if fitted.history else {},
        history=fitted.history,
        checkpoint_uri=last.resolve().as_uri() if last else None,
        model_uri=model_path.as_uri(),
    )


def load_model(config: TransformerConfig, model_path: str | Path) -> TransformerClassifier:
    """Rebuild the model and load exported weights with the safe loader."""
    model = build_model(config)
    model.load_state_dict(torch.load(model_path, map_location="cpu", weights_only=True))
    return model.eval()


@torch.no_grad()
def evaluate(config: TransformerConfig, model: nn.Module) -> dict[str, float]:
    """Held-out loss and accuracy (chance is 1/num_classes)."""
    tokens, labels = make_samples(config, config.data.num_eval_samples, seed=-1)
    metrics = compute(model, (tokens, labels))
    return {f"eval_{k}": v.item() for k, v in metrics.items()}
