"""Regression with a simple MLP under DDP: the "hello world" of distributed training.

`train` runs on every rank with the strategy the technique subflow chose (DDP by default) and
the shared loop; `evaluate` runs wherever the trained weights are.
"""

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainflow import checkpoint, runtime
from trainflow.configs.mlp import MLPConfig
from trainflow.efficiency import matmul_params, training_flops
from trainflow.models.mlp import SimpleMLP
from trainflow.strategies.base import Strategy
from trainflow.strategies.job import TrainResult, local_path
from trainflow.strategies.loop import Batch, SampleLog, Schedule, Work, exported, fit
from trainflow.tracking import (
    PROGRESS_FILE,
    SINK_IMPORTS,
    metrics_sink,
    register_pytorch_model,
)
from trainflow.workloads import Evaluation

# Imported by rank 0 only once it logs; the launch's standby agent imports it ahead.
RANK_IMPORTS = SINK_IMPORTS

# Ground-truth function parameters come from a fixed seed, so train and held-out data agree
# whatever seed the run uses for sampling.
_TRUTH_SEED = 1234


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


def steps_per_epoch(config: MLPConfig, world_size: int) -> int:
    """Full batches each rank gets from one pass over its shard of the training rows."""
    return (config.num_train_samples // world_size) // config.batch_size


def _batches(config: MLPConfig, start_step: int = 0) -> Iterator[list[Batch]]:
    """This rank's shard of the training rows, reshuffled each epoch, one micro-batch a step.

    The order is a function of the seed and the epoch only, so a run resumed after `start_step`
    steps continues at the very batch the uninterrupted run would have drawn next. Batches are
    `(x, y, row_ids)`.
    """
    x, y = make_regression(
        config.num_train_samples, config.num_features, config.seed, config.noise_std
    )
    dataset = TensorDataset(x, y, torch.arange(len(x)))
    sampler: DistributedSampler = DistributedSampler(
        dataset, shuffle=True, seed=config.seed, drop_last=True
    )
    loader = DataLoader(dataset, batch_size=config.batch_size, sampler=sampler, drop_last=True)
    per_epoch = steps_per_epoch(config, runtime.get_world_size())
    first_epoch, skip = divmod(start_step, per_epoch)
    for epoch in range(first_epoch, config.num_epochs):
        sampler.set_epoch(epoch)
        batches: Iterator[Batch] = iter(loader)
        if epoch == first_epoch:
            batches = itertools.islice(batches, skip, None)
        for batch in batches:
            yield [batch]


def num_steps(config: MLPConfig, world_size: int) -> int:
    """Steps of `num_epochs` full batches on every rank, capped by `max_steps`."""
    total = config.num_epochs * steps_per_epoch(config, world_size)
    return min(total, config.max_steps or total)


def compute(model: nn.Module, batch: Batch) -> dict[str, Tensor]:
    """Mean squared error of one micro-batch."""
    x, y, _row_ids = batch
    return {"loss": F.mse_loss(model(x), y)}


def sample_log_path(output_dir: str | Path, rank: int) -> Path:
    """Where rank `rank` records the row ids it trained on (with `log_samples`)."""
    return Path(output_dir) / "samples" / f"rank_{rank}.jsonl"


def build_model(config: MLPConfig) -> SimpleMLP:
    """The MLP described by `config`, freshly initialised."""
    return SimpleMLP(config.num_features, config.hidden_size)


def train(
    config: MLPConfig,
    strategy: Strategy,
    *,
    output_dir: str,
    mlflow_run_id: str | None = None,
    resume_from: str | None = None,
) -> TrainResult:
    """Train on this rank with `strategy` (DDP by default); export the weights as `model.pt`.

    Continues from the latest complete checkpoint under `resume_from` when there is one: the
    weights, the optimizer, the RNG streams and the data order (a function of the step).
    """
    rank, world = runtime.get_global_rank(), runtime.get_world_size()
    torch.manual_seed(config.seed)
    model = build_model(config)
    # Every weight of an MLP multiplies each sample once.
    work = Work(flops_per_sample=training_flops(matmul_params(model)))
    strategy.wrap(
        model,
        config.optimizer,
        micro_batch_size=config.batch_size,
        grad_accum_steps=1,
    )
    start = 0
    if (resume := checkpoint.resolve(resume_from)) is not None:
        start, _ = strategy.load(resume)
        runtime.print0(f"resumed from {resume} at step {start}")
    steps = num_steps(config, world)
    print(
        f"rank {rank}/{world} on {strategy.device}: "
        f"{config.num_train_samples // world} rows, {steps} steps of {config.batch_size}",
        flush=True,
    )
    batches = _batches(config, start)
    samples = sample_log_path(output_dir, rank) if config.log_samples else None
    fitted = fit(
        strategy,
        lambda _step: next(batches),
        compute,
        Schedule.of(steps, config.log_every, config),
        metrics_sink(mlflow_run_id, runtime.is_rank_zero()),
        Path(output_dir) / "checkpoints",
        start_step=start,
        progress_file=Path(output_dir) / PROGRESS_FILE,
        sample_log=SampleLog(samples, lambda batch: batch[2].tolist()),
        work=work,
    )
    return exported(strategy, fitted, output_dir)


def load_model(config: MLPConfig, model_path: str | Path) -> SimpleMLP:
    """Rebuild the model and load the trained weights with the safe loader."""
    model = build_model(config)
    model.load_state_dict(torch.load(model_path, map_location="cpu", weights_only=True))
    return model.eval()


@torch.no_grad()
def held_out_metrics(config: MLPConfig, model: torch.nn.Module) -> dict[str, float]:
    """Held-out MSE and R^2 (R^2 > 0 means better than predicting the mean)."""
    x, y = make_regression(
        config.num_eval_samples, config.num_features, config.seed + 10_000, config.noise_std
    )
    pred = model(x)
    mse = torch.mean((pred - y) ** 2).item()
    variance = torch.var(y, unbiased=False).item()
    return {"eval_mse": mse, "eval_r2": 1.0 - mse / variance, "eval_baseline_mse": variance}


def evaluate(config: MLPConfig, trained: TrainResult) -> Evaluation:
    """Held-out metrics of the trained weights, which are kept for registration."""
    model = load_model(config, local_path(trained.model_uri))
    return Evaluation(held_out_metrics(config, model), model)


def log_model(
    config: MLPConfig, evaluation: Evaluation, run_id: str, name: str, tags: dict[str, str]
) -> str:
    """Log the trained `nn.Module` to the run and add a registry version."""
    x, _ = make_regression(4, config.num_features, 0, 0.0)
    return register_pytorch_model(run_id, evaluation.model, name, x.numpy(), tags)
