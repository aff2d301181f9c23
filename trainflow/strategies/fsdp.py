"""FSDP2: `fully_shard` each repeated block, then the root; checkpoints with DCP."""

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.distributed._composable import checkpoint as activation_checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from trainflow import runtime
from trainflow.strategies.base import TorchStrategy, adamw, find_blocks
from trainflow.strategies.config import FSDPConfig, OptimizerConfig


class FSDPStrategy(TorchStrategy):
    """Per-block sharding with optional HSDP, mixed precision, offload and recomputation."""

    name = "fsdp"
    config: FSDPConfig

    def check_model(self, model: nn.Module) -> None:
        """FSDP needs blocks to shard one at a time; a model without them gains nothing."""
        if not find_blocks(model):
            raise ValueError(
                f"technique fsdp: {type(model).__name__} has no repeated blocks to shard "
                "(an nn.ModuleList of layers of one class); use technique ddp for it"
            )

    def _mesh(self) -> DeviceMesh:
        world = runtime.get_world_size()
        self.config.check_world_size(world)
        replicas = self.config.replicate_degree
        if replicas == 1:
            return init_device_mesh(self.device.type, (world,))
        return init_device_mesh(
            self.device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
        )

    def wrap(
        self,
        model: nn.Module,
        optimizer: OptimizerConfig,
        *,
        micro_batch_size: int,
        grad_accum_steps: int,
    ) -> tuple[nn.Module, Any]:
        self.check_model(model)
        bf16 = self.config.mixed_precision == "bf16"
        options: dict[str, Any] = {
            "mesh": self._mesh(),
            "reshard_after_forward": self.config.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=torch.bfloat16 if bf16 else None,
                reduce_dtype=torch.float32 if bf16 else None,
            ),
            "offload_policy": CPUOffloadPolicy() if self.config.cpu_offload else OffloadPolicy(),
        }
        if not self.config.cpu_offload:
            model = model.to(self.device)
        for block in find_blocks(model):
            if self.config.activation_checkpointing:
                activation_checkpoint(block)
            fully_shard(block, **options)
        fully_shard(model, **options)
        self.model = model
        self.optimizer = adamw(model.parameters(), optimizer)
        return model, self.optimizer

    @contextlib.contextmanager
    def micro_batch(self, sync: bool) -> Iterator[None]:
        """Keep unsharded gradients local on all but the last micro-batch."""
        model = cast(FSDPModule, self.wrapped)
        model.set_requires_gradient_sync(sync)
        yield
