"""The strategy interface every technique implements, and what DDP and FSDP share.

A strategy wraps a model and builds its optimizer, runs backward and the optimizer step (the
place DeepSpeed's engine needs), saves and loads checkpoints, and exports one consolidated
`nn.Module` state dict for registration. The train loop talks only to this interface.

A strategy also declares its settings for the frameworks that own their own loop, one method
per framework (`hf_settings`, `lightning_settings`); the adapters in
`trainflow.strategies.frameworks` apply them, so a workload never branches on technique:

    batches = {"micro_batch_size": 8, "grad_accum_steps": 1, "optimizer": OptimizerConfig()}
    args = strategy.hf_trainer_args(**batches, layer_classes=["LlamaDecoderLayer"])
    trainer = Trainer(args=TrainingArguments(..., **args), ...)
    strategy.prepare_hf_trainer(trainer)

    lightning.Trainer(strategy=strategy.lightning_strategy(**batches), ...)
"""

import contextlib
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from trainflow import checkpoint, runtime, storage
from trainflow.compat import safe_load
from trainflow.errors import FrameworkError
from trainflow.strategies import frameworks
from trainflow.strategies.config import FRAMEWORKS, OptimizerConfig
from trainflow.strategies.frameworks import Batches, HFSettings

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of `model`: entries of an `nn.ModuleList` whose modules share a class.

    These are the units FSDP shards one at a time (transformer layers, in practice).
    """
    blocks: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            kinds = {type(m) for m in module}
            if len(kinds) == 1 and any(True for _ in module.parameters()):
                blocks.extend(module)
    return blocks


def adamw(params: Any, config: OptimizerConfig) -> torch.optim.Optimizer:
    """torch's AdamW from the typed optimizer config."""
    return torch.optim.AdamW(
        params,
        lr=config.learning_rate,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
    )


def gather_full_state_dict(module: nn.Module) -> dict[str, Any]:
    """The whole model's state dict on CPU, gathered from the shards of every rank.

    A collective: every rank must call it. The dict is complete on rank 0 and empty on the other
    ranks. Works on plain, DDP- and FSDP2-wrapped modules alike (the Hugging Face Trainer's
    `trainer.model` included).
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(module, options=options)


@dataclass
class _InFlight:
    """A checkpoint whose files are still being written in the background."""

    partial: Path
    path: Path
    step: int
    keep: int | None
    written: Future
    published: bool = False  # by rank 0, once its write (and so every rank's) ended


class Strategy(ABC):
    """One technique's way to wrap, step, checkpoint and export a model.

    Call `wrap` once; the other methods use the model and optimizer it returned.
    """

    name: ClassVar[str]

    def __init__(self, config: Any):
        # Every load of a checkpoint on this rank refuses pickled code, whichever framework
        # loads it (DCP's metadata and values, DeepSpeed's files).
        safe_load.install()
        self.config = config
        self.device = runtime.get_device()
        self.model: nn.Module | None = None
        self.optimizer: Any = None
        self._in_flight: _InFlight | None = None

    @property
    def wrapped(self) -> nn.Module:
        """The model `wrap` returned."""
        if self.model is None:
            raise RuntimeError(f"{self.name}: call wrap() first")
        return self.model

    def check_model(self, model: nn.Module) -> None:  # noqa: B027 - optional hook
        """Raise `ValueError` if this technique cannot train `model` (called before launch).

        Args:
            model: The workload's model, built on the meta device (no memory, no data).
        """

    @abstractmethod
    def wrap(
        self,
        model: nn.Module,
        optimizer: OptimizerConfig,
        *,
        micro_batch_size: int,
        grad_accum_steps: int,
    ) -> tuple[nn.Module, Any]:
        """Apply the technique to `model` and build its optimizer.

        Args:
            model: The freshly built model, identical on every rank.
            optimizer: AdamW settings.
            micro_batch_size: Samples per rank per micro-batch.
            grad_accum_steps: Micro-batches per optimizer step.

        Returns:
            The model to call in the loop and the optimizer.
        """

    def hf_trainer_args(
        self,
        *,
        micro_batch_size: int,
        grad_accum_steps: int,
        optimizer: OptimizerConfig,
        layer_classes: list[str],
        device_type: str | None = None,
    ) -> dict[str, Any]:
        """Hugging Face `TrainingArguments` settings that apply this technique
        (`frameworks.hf_trainer_args`).

        Args:
            micro_batch_size: Samples per rank per micro-batch (DeepSpeed's JSON repeats it).
            grad_accum_steps: Micro-batches per optimizer step (likewise).
            optimizer: AdamW settings (likewise).
            layer_classes: Class names of the model's repeated blocks (FSDP wraps each).
            device_type: "cuda" or "cpu"; default: this rank's device.

        Raises:
            FrameworkError: the Hugging Face Trainer cannot run this technique.
        """
        batches = Batches(micro_batch_size, grad_accum_steps, optimizer)
        return frameworks.hf_trainer_args(
            self, batches, layer_classes=layer_classes, device_type=device_type or self.device.type
        )

    def hf_settings(
        self, batches: Batches, *, layer_classes: list[str], device_type: str
    ) -> HFSettings:
        """This technique's own `TrainingArguments` settings and environment (none: refused)."""
        raise FrameworkError(f"technique {self.name} has no settings for {FRAMEWORKS['hf']}")

    def prepare_hf_trainer(self, trainer: Any) -> None:  # noqa: B027 - optional hook
        """Adjust a Hugging Face Trainer built from `hf_trainer_args`, before `train()`."""

    def lightning_strategy(
        self, *, micro_batch_size: int, grad_accum_steps: int, optimizer: OptimizerConfig
    ) -> "ParallelStrategy":
        """The Lightning `Strategy` that applies this technique inside the launched ranks
        (`frameworks.lightning_strategy`).

        It uses the torchelastic environment the launcher set up (`TorchElasticEnvironment`),
        so Lightning starts no processes and reuses an open process group. Give the Lightning
        Trainer `devices` and `num_nodes` that multiply to the world size, and call
        `prepare_lightning_model` from the LightningModule's `configure_model`.

        Args:
            micro_batch_size: Samples per rank per micro-batch (DeepSpeed's JSON needs it).
            grad_accum_steps: Micro-batches per optimizer step; the Trainer's
                `accumulate_grad_batches` must match it.
            optimizer: AdamW settings (DeepSpeed builds its optimizer from them).

        Raises:
            FrameworkError: Lightning cannot run this technique (on this device).
        """
        batches = Batches(micro_batch_size, grad_accum_steps, optimizer)
        return frameworks.lightning_strategy(self, batches)

    def lightning_settings(self, batches: Batches) -> "ParallelStrategy":
        """This technique's own Lightning strategy object (none: refused)."""
        raise FrameworkError(f"technique {self.name} has no settings for {FRAMEWORKS['lightning']}")

    def prepare_lightning_model(self, model: nn.Module) -> None:  # noqa: B027 - optional hook
        """Apply what Lightning's strategy leaves to the model, in place; safe to call again.

        Call it from `LightningModule.configure_model` on the model the module holds. Nothing
        by default: Lightning's DDP and DeepSpeed strategies wrap the model themselves.
        """

    @contextlib.contextmanager
    def micro_batch(self, sync: bool) -> Iterator[None]:
        """Wrap the forward and backward of one micro-batch.

        Args:
            sync: False on all but the last micro-batch of a step: gradients may stay local.
        """
        yield

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch's (already accumulation-scaled) loss."""
        loss.backward()

    def step(self) -> None:
        """Apply the accumulated gradients and clear them."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def save(
        self,
        path: Path,
        step: int,
        keep: int | None = None,
        extra: dict[str, Any] | None = None,
        background: bool = False,
    ) -> None:
        """Checkpoint model, optimizer, step, every rank's RNG streams and `extra` to `path`.

        Every rank calls this. The files are written to a partial folder first; rank 0 makes it
        visible as `path` only once every rank has finished, then keeps the newest `keep`.

        With `background` (where the technique can: `supports_background_save`), the state is
        copied to host memory and written by a thread while training goes on; the checkpoint
        is published once every rank's files are written, by the first of `poll_saves` (after
        each step), the next `save` or `finish_saves`. One save is in flight at most: the next
        waits for it. A run that dies before then leaves only the partial folder, which no
        resume reads.

        Args:
            path: The checkpoint folder (`checkpoint.checkpoint_path(root, step)`).
            step: Optimizer steps done.
            keep: Complete checkpoints to keep under `path.parent` (None: all).
            extra: This rank's small resume values (e.g. the data position).
            background: Write the files in the background.
        """
        self.finish_saves()
        partial = checkpoint.partial_path(path)
        if runtime.is_rank_zero():
            shutil.rmtree(partial, ignore_errors=True)  # a save an earlier attempt left
            partial.mkdir(parents=True)
        dist.barrier()
        checkpoint.save_rank_state(partial, runtime.get_global_rank(), extra)
        if background and self.supports_background_save:
            self._in_flight = _InFlight(partial, path, step, keep, self._save_background(partial))
            return
        self._save(partial)
        self._publish(partial, path, step, keep)

    def poll_saves(self) -> None:
        """Publish the checkpoint written in the background as soon as it is whole, without
        waiting for the next save (the loop calls this after every step; no collective).

        Rank 0's write ends only once every rank's has: the technique gathers every rank's
        result to rank 0 before it finishes the checkpoint (DCP writes its metadata there).

        Raises:
            Exception: what writing this rank's files raised.
        """
        flight = self._in_flight
        if flight is None or flight.published or not flight.written.done():
            return
        flight.written.result()
        if runtime.is_rank_zero():
            self._publish_now(flight.partial, flight.path, flight.step, flight.keep)
        flight.published = True

    def finish_saves(self) -> None:
        """Wait for the checkpoint being written in the background, if any, and publish it.

        Every rank calls this at the same point (the loop: before the next save, at the end
        and on a stop).

        Raises:
            Exception: what writing this rank's files raised; the checkpoint is not published.
        """
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        flight.written.result()
        # Every rank meets in `_publish`'s barriers, whether or not `poll_saves` published it.
        self._publish(flight.partial, flight.path, flight.step, flight.keep, flight.published)

    def _publish(
        self, partial: Path, path: Path, step: int, keep: int | None, done: bool = False
    ) -> None:
        dist.barrier()  # every rank's files are written
        if runtime.is_rank_zero() and not done:
            self._publish_now(partial, path, step, keep)
        dist.barrier()

    def _publish_now(self, partial: Path, path: Path, step: int, keep: int | None) -> None:
        checkpoint.publish(
            partial, path, step, keep=keep, technique=self.name, world_size=runtime.get_world_size()
        )
        storage.mirror_checkpoint(path)  # a run kept in object storage: upload it there

    @property
    def supports_background_save(self) -> bool:
        """Whether `save(background=True)` writes in the background (else it saves at once)."""
        return False

    def _save_background(self, path: Path) -> Future:
        """Copy the state to host memory, then write it to `path` in a thread; the future
        ends when this rank's files are written."""
        raise NotImplementedError(f"{self.name} saves checkpoints in the foreground only")

    def load(self, path: Path) -> tuple[int, dict[str, Any] | None]:
        """Restore model, optimizer and this rank's RNG streams from the checkpoint at `path`.

        Returns:
            The checkpoint's step, and this rank's `extra` (None when the checkpoint has no
            state for this rank: it was written by fewer ranks).
        """
        step = int(checkpoint.read_meta(path)["step"])
        self._load(path)
        return step, checkpoint.load_rank_state(path, runtime.get_global_rank())

    @abstractmethod
    def _save(self, path: Path) -> None: ...

    @abstractmethod
    def _load(self, path: Path) -> None: ...

    @abstractmethod
    def export(self, path: Path) -> None:
        """Write the full model as one `torch.save`d plain `nn.Module` state dict at `path`."""


class TorchStrategy(Strategy):
    """DDP and FSDP: sharded, resharding checkpoints with `torch.distributed.checkpoint`.

    DCP saves each rank's shard with fully qualified names, so a checkpoint written by N ranks
    loads on M ranks, and under DDP as under FSDP.
    """

    _save_group: Any = None  # the gloo group background saves coordinate through

    def _save(self, path: Path) -> None:
        model_state, optim_state = get_state_dict(self.wrapped, self.optimizer)
        # A value every rank holds (DDP's whole model; buffers under FSDP) is written once, by
        # the lowest rank. Replicas can differ: DDP broadcasts rank 0's buffers (batch norm's
        # running statistics) at each forward and each rank then updates its own; rank 0's
        # are the ones the next step would have used, so they are the ones a resume needs.
        planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        dcp.save(
            {"model": model_state, "optimizer": optim_state}, checkpoint_id=path, planner=planner
        )

    @property
    def supports_background_save(self) -> bool:
        return True

    def _save_background(self, path: Path) -> Future:
        """DCP's `async_save`: the state is staged (copied to host memory) before it returns,
        so the next optimizer step may change the weights; the files are written by a thread,
        whose collectives (the save plan) use a gloo group of their own, never the training
        group's order of collectives."""
        if self._save_group is None:
            self._save_group = dist.new_group(backend="gloo")
        model_state, optim_state = get_state_dict(self.wrapped, self.optimizer)
        planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        response = dcp.async_save(
            {"model": model_state, "optimizer": optim_state},
            checkpoint_id=path,
            planner=planner,
            process_group=self._save_group,
        )
        if isinstance(response, Future):
            return response
        # A stager that copies in the background answers with two futures (not the default).
        response.staging_completion.result()
        return response.upload_completion

    def _load(self, path: Path) -> None:
        model_state, optim_state = get_state_dict(self.wrapped, self.optimizer)
        # DCP loads in place, into this rank's shards, whatever world size saved them.
        dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)
        set_state_dict(
            self.wrapped,
            self.optimizer,
            model_state_dict=model_state,
            optim_state_dict=optim_state,
        )

    def export(self, path: Path) -> None:
        """Gather the full state dict on CPU and save it from rank 0."""
        state = gather_full_state_dict(self.wrapped)
        if runtime.is_rank_zero():
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
        dist.barrier()
