"""The train loop every technique shares: micro-batches, step, log, checkpoint.

It never asks which technique runs it: the strategy decides how backward, the optimizer step,
gradient synchronisation and checkpoints work.
"""

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from trainflow import checkpoint, runtime
from trainflow.efficiency import EfficiencyMeter
from trainflow.errors import Preempted
from trainflow.strategies.base import Strategy
from trainflow.strategies.job import TrainResult
from trainflow.tracking import MetricsSink, ProgressFile

# A micro-batch: tensors, or lists, tuples and dicts of them (detection targets are a list of
# dicts); `to_device` moves every tensor in it.
Batch = Any
# (model, micro-batch on the rank's device) -> {"loss": ..., other metrics}, scalar tensors.
ComputeFn = Callable[[nn.Module, Batch], Mapping[str, torch.Tensor]]
# A micro-batch -> (samples, tokens) it holds; tokens 0 for models without tokens.
WorkFn = Callable[[Batch], tuple[int, int]]


def count_samples(batch: Batch) -> tuple[int, int]:
    """Samples of a micro-batch whose first element holds one row per sample; no tokens."""
    first = batch[0] if isinstance(batch, list | tuple) else batch
    return (int(first.shape[0]) if isinstance(first, torch.Tensor) else len(first)), 0


@dataclass(frozen=True)
class Work:
    """How to count a micro-batch's work, and the model FLOPs of a unit of it (for MFU).

    Give `flops_per_token` when `count` returns tokens, else `flops_per_sample`; neither skips
    MFU (`trainflow.efficiency`).
    """

    count: WorkFn = count_samples
    flops_per_token: float | None = None
    flops_per_sample: float | None = None


class CheckpointOptions(Protocol):
    """What `Schedule.of` reads from a pipeline config (`trainflow.configs.base.PipelineConfig`)."""

    checkpoint_every: int
    keep_checkpoints: int
    async_checkpoints: bool


@dataclass(frozen=True)
class Schedule:
    """When to stop, log and checkpoint, and how many checkpoints to keep."""

    num_steps: int
    log_every: int
    checkpoint_every: int
    keep_checkpoints: int | None = None
    # Checkpoints between the first step and the last are written in the background where the
    # technique can (`Strategy.save(background=True)`); the last one and a stop's at once.
    async_checkpoints: bool = False

    @classmethod
    def of(cls, num_steps: int, log_every: int, config: "CheckpointOptions") -> "Schedule":
        """The schedule of a pipeline's run: its steps and logging, and the checkpoint options
        every pipeline config has (`PipelineConfig`)."""
        return cls(
            num_steps,
            log_every,
            config.checkpoint_every,
            config.keep_checkpoints,
            async_checkpoints=config.async_checkpoints,
        )

    def should_log(self, step: int) -> bool:
        """Log every `log_every` steps and at the last step."""
        return step % self.log_every == 0 or step == self.num_steps

    def should_checkpoint(self, step: int) -> bool:
        """Checkpoint every `checkpoint_every` steps (0: never) and at the last step."""
        every = self.checkpoint_every
        return every > 0 and (step % every == 0 or step == self.num_steps)


@dataclass
class FitResult:
    """What `fit` did: steps reached, logged metrics by step, last checkpoint written, and how
    efficiently (`eff_*`, see `trainflow.efficiency`)."""

    steps: int
    history: dict[int, dict[str, float]] = field(default_factory=dict)
    last_checkpoint: Path | None = None
    efficiency: dict[str, float] = field(default_factory=dict)

    def last_metrics(self) -> dict[str, float]:
        """The last logged metrics as `train_<name>` and the `eff_*` figures, as the MLflow run
        has them."""
        last = self.history[max(self.history)] if self.history else {}
        return {f"train_{k}": v for k, v in last.items()} | self.efficiency


def to_device(batch: Batch, device: torch.device) -> Batch:
    """`batch` with every tensor in it moved to `device` (containers keep their type)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def mean_over_ranks(values: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Average scalar tensors over all ranks (one all-reduce)."""
    keys = sorted(values)
    stacked = torch.stack([values[k].detach().float() for k in keys])
    dist.all_reduce(stacked)
    return dict(zip(keys, (stacked / dist.get_world_size()).tolist(), strict=True))


class SampleLog:
    """Which samples this rank trained on at each step, and when the step ended: one JSON line
    per step, appended.

    A step recomputed after a resume is written again; the last line of a step is the one its
    weights came from.
    """

    def __init__(self, path: Path | None, ids: Callable[[Batch], list[int]]):
        self.path = path
        self.ids = ids
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, step: int, micro: Sequence[Batch]) -> None:
        if self.path is None:
            return
        ids = [i for batch in micro for i in self.ids(batch)]
        line = {"step": step, "time": time.time(), "ids": ids}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def read_sample_log(path: str | Path) -> dict[int, list[int]]:
    """Step -> sample ids from a `SampleLog` file (the last record of a step wins)."""
    steps: dict[int, list[int]] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record["ids"]
    return steps


def fit(
    strategy: Strategy,
    batches: Callable[[int], Sequence[Batch]],
    compute: ComputeFn,
    schedule: Schedule,
    sink: MetricsSink,
    checkpoint_root: Path,
    start_step: int = 0,
    progress_file: Path | None = None,
    sample_log: SampleLog | None = None,
    work: Work = Work(),
) -> FitResult:
    """Train from `start_step` to `schedule.num_steps`.

    After every step the ranks agree whether a stop was requested (SIGTERM to the ranks: a
    preemption, Ctrl-C or a cancel upstream); if so they write a checkpoint at the step reached
    and raise `Preempted`, so the run can continue from there.

    Args:
        strategy: A strategy whose `wrap` has run.
        batches: Step number (1-based) -> this rank's micro-batches for that step.
        compute: Forward one micro-batch; returns the loss and any other metrics.
        schedule: Steps, logging and checkpoint cadence.
        sink: Where rank 0 logs metrics (a null sink elsewhere).
        checkpoint_root: Folder for `step_NNNNNN` checkpoints.
        start_step: Steps already done (from a checkpoint).
        progress_file: Where rank 0 records steps done (other ranks and None: nowhere).
        sample_log: Where this rank records the sample ids of each step (None: nowhere).
        work: How to count a micro-batch's samples and tokens, and their FLOPs; the
            efficiency figures are logged at the last step (`FitResult.efficiency`).

    Raises:
        Preempted: a stop was requested; the checkpoint of the step reached is written.
    """
    model, device = strategy.wrapped, strategy.device
    result = FitResult(steps=start_step)
    progress = ProgressFile(progress_file if runtime.is_rank_zero() else None, schedule.num_steps)
    meter = EfficiencyMeter(
        device, flops_per_token=work.flops_per_token, flops_per_sample=work.flops_per_sample
    )
    for step in range(start_step + 1, schedule.num_steps + 1):
        with meter.data_wait():
            micro = batches(step)
        totals: dict[str, torch.Tensor] = {}
        for i, batch in enumerate(micro):
            meter.count(*work.count(batch))
            with strategy.micro_batch(sync=i == len(micro) - 1):
                metrics = compute(model, to_device(batch, device))
                strategy.backward(metrics["loss"] / len(micro))
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0) + value.detach() / len(micro)
        strategy.step()
        strategy.poll_saves()  # a checkpoint written in the background is published once whole
        meter.step()
        result.steps = step
        runtime.heartbeat(step)
        if sample_log is not None:
            sample_log.record(step, micro)
        if schedule.should_log(step):
            logged = mean_over_ranks(totals)
            result.history[step] = logged
            sink.log(step, {f"train_{k}": v for k, v in logged.items()})
            shown = " ".join(f"{k} {v:.4f}" for k, v in logged.items())
            runtime.print0(f"step {step}/{schedule.num_steps} {shown}")
            progress.update(step)
        stop = runtime.should_stop()
        if schedule.should_checkpoint(step) or (stop and schedule.checkpoint_every > 0):
            # What was logged up to this step is stored before the checkpoint can be resumed
            # from: a resumed run logs from the next step on, so a kill now leaves no gap.
            sink.flush()
            path = checkpoint.checkpoint_path(checkpoint_root, step)
            background = schedule.async_checkpoints and not stop and step < schedule.num_steps
            strategy.save(path, step, keep=schedule.keep_checkpoints, background=background)
            result.last_checkpoint = path
        if stop:
            sink.flush()
            progress.update(step)
            saved = (
                f"checkpoint {result.last_checkpoint}"
                if result.last_checkpoint
                else "no checkpoint"
            )
            runtime.print0(f"stop requested: stopped after step {step}; {saved}")
            raise Preempted(
                f"rank {runtime.get_global_rank()} stopped on request after step {step} ({saved})"
            )
    strategy.finish_saves()
    result.efficiency = meter.report()  # every rank: it gathers the ranks' figures
    sink.log(result.steps, result.efficiency)
    sink.flush()
    progress.update(result.steps)
    return result


def exported(strategy: Strategy, fitted: FitResult, output_dir: str | Path) -> TrainResult:
    """Export the trained weights to `output_dir/model.pt` and describe what `fit` did: what
    a workload trained by this loop returns from every rank."""
    model_path = Path(output_dir).resolve() / "model.pt"
    strategy.export(model_path)
    return TrainResult(
        technique=strategy.name,
        world_size=runtime.get_world_size(),
        wrapped_as=type(strategy.wrapped).__name__,
        steps=fitted.steps,
        metrics=fitted.last_metrics(),
        history=fitted.history,
        checkpoint_uri=checkpoint.uri(fitted.last_checkpoint),
        model_uri=model_path.as_uri(),
    )
