"""DDP: a full replica per rank, gradients all-reduced in buckets during backward."""

import contextlib
from collections.abc import Iterator
from typing import Any, cast

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainflow.strategies.base import TorchStrategy, adamw
from trainflow.strategies.config import DDPConfig, OptimizerConfig


class DDPStrategy(TorchStrategy):
    """`DistributedDataParallel` with `no_sync` for gradient accumulation."""

    name = "ddp"
    config: DDPConfig

    def wrap(
        self,
        model: nn.Module,
        optimizer: OptimizerConfig,
        *,
        micro_batch_size: int,
        grad_accum_steps: int,
    ) -> tuple[nn.Module, Any]:
        on_gpu = self.device.type == "cuda"
        self.model = DistributedDataParallel(
            model.to(self.device),
            device_ids=[self.device.index] if on_gpu else None,
            bucket_cap_mb=self.config.bucket_cap_mb,
            find_unused_parameters=self.config.find_unused_parameters,
        )
        self.optimizer = adamw(self.model.parameters(), optimizer)
        return self.model, self.optimizer

    @contextlib.contextmanager
    def micro_batch(self, sync: bool) -> Iterator[None]:
        """Skip the all-reduce on all but the last micro-batch (forward included, as DDP needs)."""
        ddp = cast(DistributedDataParallel, self.wrapped)
        with contextlib.nullcontext() if sync else ddp.no_sync():
            yield
