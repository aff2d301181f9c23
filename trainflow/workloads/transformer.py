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
from torch import Tensor, nn

from trainflow import checkpoint, runtime
from trainflow.configs.transformer import TransformerConfig
from trainflow.efficiency import matmul_params, training_flops
from trainflow.models.transformer import TransformerClassifier
from trainflow.strategies.base import Strategy
from trainflow.strategies.job import TrainResult, local_path
from trainflow.strategies.loop import Batch, Schedule, Work, exported, fit
from trainflow.tracking import (
    PROGRESS_FILE,
    SINK_IMPORTS,
    metrics_sink,
    register_pytorch_model,
)
from trainflow.workloads import Evaluation

# Imported by rank 0 only once it logs; the launch's standby agent imports it ahead.
RANK_IMPORTS = SINK_IMPORTS

# The classes' key tokens come from a fixed seed: training and held-out data always agree.
_TRUTH_SEED = 4321


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


def wrap_model(config: TransformerConfig, strategy: Strategy) -> Work:
    """Build the seeded model and hand it, with its optimizer, to `strategy` on this rank.

    Returns how the loop counts its work: every token of a micro-batch, at the model FLOPs of
    its linear layers and attention over the whole sequence.
    """
    t, m = config.training, config.model
    torch.manual_seed(t.seed)
    model = build_model(config)
    flops = training_flops(
        matmul_params(model), num_layers=m.num_layers, hidden_size=m.d_model, seq_len=m.seq_len
    )
    strategy.wrap(
        model,
        t.optimizer,
        micro_batch_size=t.micro_batch_size(runtime.get_world_size()),
        grad_accum_steps=t.grad_accum_steps,
    )
    return Work(count=count_tokens, flops_per_token=flops)


def count_tokens(batch: Batch) -> tuple[int, int]:
    """Sequences and tokens of a micro-batch (no padding: every sequence is `seq_len` long)."""
    tokens, _labels = batch
    return int(tokens.shape[0]), int(tokens.numel())


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
    work = wrap_model(config, strategy)
    start = 0
    if (resume := checkpoint.resolve(resume_from)) is not None:
        start, _ = strategy.load(resume)
        runtime.print0(f"resumed from {resume} at step {start}")
    fitted = fit(
        strategy,
        lambda step: micro_batches(config, step, rank, world),
        compute,
        Schedule.of(t.num_steps, t.log_every, config),
        metrics_sink(mlflow_run_id, runtime.is_rank_zero()),
        Path(output_dir) / "checkpoints",
        start_step=start,
        progress_file=Path(output_dir) / PROGRESS_FILE,
        work=work,
    )
    return exported(strategy, fitted, output_dir)


def load_model(config: TransformerConfig, model_path: str | Path) -> TransformerClassifier:
    """Rebuild the model and load exported weights with the safe loader."""
    model = build_model(config)
    model.load_state_dict(torch.load(model_path, map_location="cpu", weights_only=True))
    return model.eval()


@torch.no_grad()
def held_out_metrics(config: TransformerConfig, model: nn.Module) -> dict[str, float]:
    """Held-out loss and accuracy (chance is 1/num_classes)."""
    tokens, labels = make_samples(config, config.data.num_eval_samples, seed=-1)
    metrics = compute(model, (tokens, labels))
    return {f"eval_{k}": v.item() for k, v in metrics.items()}


def evaluate(config: TransformerConfig, trained: TrainResult) -> Evaluation:
    """Held-out metrics of the exported weights, which are kept for registration."""
    model = load_model(config, local_path(trained.model_uri))
    return Evaluation(held_out_metrics(config, model), model)


def log_model(
    config: TransformerConfig,
    evaluation: Evaluation,
    run_id: str,
    name: str,
    tags: dict[str, str],
) -> str:
    """Log the trained `nn.Module` to the run and add a registry version."""
    tokens, _ = make_samples(config, 2, seed=0)
    return register_pytorch_model(run_id, evaluation.model, name, tokens.numpy(), tags)
