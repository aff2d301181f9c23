"""Regression with a simple MLP under DDP: the "hello world" of distributed training.

`train` runs on every rank (any launcher: `trainflow.distributed`, torchrun, Ray); `evaluate`
runs wherever the trained weights are.
"""

import math
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainflow import runtime
from trainflow.models.mlp import SimpleMLP
from trainflow.paths import SafeName
from trainflow.tracking import metrics_sink

# Ground-truth function parameters come from a fixed seed, so train and held-out data agree
# whatever seed the run uses for sampling.
_TRUTH_SEED = 1234


class MLPConfig(BaseModel):
    """Everything the MLP pipeline needs; shown as the run form in the Prefect UI."""

    model_config = ConfigDict(extra="forbid")

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
    gpus: int = Field(2, ge=1, description="Number of ranks (GPUs, or CPU processes on CPU).")
    gpu_type: str | None = Field(
        None, description='GPU type such as "H100"; "cpu" forces CPU ranks; empty: what exists.'
    )
    timeout_s: float = Field(900, gt=0, description="Bound on the whole training launch.")
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


def make_regression(
    num_samples: int, num_features: int, seed: int, noise_std: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic regression: y = x.w + 0.5 sin(3 x.v) + noise."""
    truth = torch.Generator().manual_seed(_TRUTH_SEED)
    w = torch.randn(num_features, generator=truth) / math.sqrt(num_features)
    v = torch.randn(num_features, generator=truth) / math.sqrt(num_features)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, num_features, generator=gen)
    y = x @ w + 0.5 * torch.sin(3 * (x @ v)) + noise_std * torch.randn(num_samples, generator=gen)
    return x, y.unsqueeze(1)


def train(config: MLPConfig, output_dir: str, mlflow_run_id: str | None = None) -> dict:
    """Train with DDP on the current rank; rank 0 logs to MLflow and saves `model.pt`.

    Returns this rank's summary: steps, final loss, samples seen.
    """
    backend = None if config.backend == "auto" else config.backend
    with runtime.process_group(backend):
        device = runtime.get_device()
        torch.manual_seed(config.seed)
        x, y = make_regression(
            config.num_train_samples, config.num_features, config.seed, config.noise_std
        )
        dataset = TensorDataset(x, y)
        sampler: DistributedSampler = DistributedSampler(
            dataset, shuffle=True, seed=config.seed, drop_last=True
        )
        loader = DataLoader(dataset, batch_size=config.batch_size, sampler=sampler, drop_last=True)
        model = SimpleMLP(config.num_features, config.hidden_size).to(device)
        ddp = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        optimizer = torch.optim.Adam(ddp.parameters(), lr=config.learning_rate)
        sink = metrics_sink(mlflow_run_id, runtime.is_rank_zero())
        total = config.num_epochs * len(loader)
        max_steps = min(total, config.max_steps or total)
        print(
            f"rank {runtime.get_global_rank()}/{runtime.get_world_size()} on {device}: "
            f"{len(sampler)} rows, {len(loader)} steps per epoch, {max_steps} steps",
            flush=True,
        )
        step, loss_value, seen = 0, float("nan"), 0
        for epoch in range(config.num_epochs):
            sampler.set_epoch(epoch)
            for xb, yb in loader:
                xb, yb = xb.to(device), yb.to(device)
                loss = torch.nn.functional.mse_loss(ddp(xb), yb)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                seen += len(xb)
                if step % config.log_every == 0 or step == max_steps:
                    reduced = loss.detach().clone()
                    dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
                    loss_value = reduced.item()
                    sink.log(step, {"train_loss": loss_value, "epoch": epoch})
                    runtime.print0(f"step {step}/{max_steps} epoch {epoch} loss {loss_value:.4f}")
                if step >= max_steps:
                    break
            if step >= max_steps:
                break
        sink.flush()
        if runtime.is_rank_zero():
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), Path(output_dir) / "model.pt")
        dist.barrier()
        return {
            "rank": runtime.get_global_rank(),
            "steps": step,
            "final_loss": loss_value,
            "samples_seen": seen,
        }


def load_model(config: MLPConfig, model_path: str | Path) -> SimpleMLP:
    """Rebuild the model and load the trained weights with the safe loader."""
    model = SimpleMLP(config.num_features, config.hidden_size)
    model.load_state_dict(torch.load(model_path, map_location="cpu", weights_only=True))
    return model.eval()


@torch.no_grad()
def evaluate(config: MLPConfig, model: torch.nn.Module) -> dict[str, float]:
    """Held-out MSE and R^2 (R^2 > 0 means better than predicting the mean)."""
    x, y = make_regression(
        config.num_eval_samples, config.num_features, config.seed + 10_000, config.noise_std
    )
    pred = model(x)
    mse = torch.mean((pred - y) ** 2).item()
    variance = torch.var(y, unbiased=False).item()
    return {"eval_mse": mse, "eval_r2": 1.0 - mse / variance, "eval_baseline_mse": variance}
