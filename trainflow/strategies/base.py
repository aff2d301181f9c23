"""The strategy interface every technique implements, and what DDP and FSDP share.

A strategy wraps a model and builds its optimizer, runs backward and the optimizer step (the
place DeepSpeed's engine needs), saves and loads checkpoints, and exports one consolidated
`nn.Module` state dict for registration. The train loop talks only to this interface.
"""

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from trainflow import checkpoint, runtime
from trainflow.strategies.config import OptimizerConfig


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


class Strategy(ABC):
    """One technique's way to wrap, step, checkpoint and export a model.

    Call `wrap` once; the other methods use the model and optimizer it returned.
    """

    name: ClassVar[str]

    def __init__(self, config: Any):
        self.config = config
        self.device = runtime.get_device()
        self.model: nn.Module | None = None
        self.optimizer: Any = None

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

    def save(self, path: Path, step: int) -> None:
        """Write a checkpoint of model, optimizer and step to `path` (every rank calls this)."""
        self._save(path)
        dist.barrier()
        if runtime.is_rank_zero():
            checkpoint.mark_complete(
                path, step, technique=self.name, world_size=runtime.get_world_size()
            )
        dist.barrier()

    def load(self, path: Path) -> int:
        """Restore model and optimizer from the checkpoint at `path`; return its step."""
        step = int(checkpoint.read_meta(path)["step"])
        self._load(path)
        return step

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

    def _save(self, path: Path) -> None:
        model_state, optim_state = get_state_dict(self.wrapped, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)

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
        state = get_model_state_dict(
            self.wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if runtime.is_rank_zero():
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
        dist.barrier()
