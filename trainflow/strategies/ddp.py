"""DDP: a full replica per rank, gradients all-reduced in buckets during backward."""

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainflow import runtime
from trainflow.strategies.base import TorchStrategy, adamw
from trainflow.strategies.config import DDPConfig, OptimizerConfig
from trainflow.strategies.frameworks import Batches, HFSettings

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy


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

    def hf_settings(
        self, batches: Batches, *, layer_classes: list[str], device_type: str
    ) -> HFSettings:
        return HFSettings(
            {
                # The Trainer takes whole MiB.
                "ddp_bucket_cap_mb": max(1, round(self.config.bucket_cap_mb)),
                "ddp_find_unused_parameters": self.config.find_unused_parameters,
            }
        )

    def lightning_settings(self, batches: Batches) -> "ParallelStrategy":
        from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy

        # Extra keywords go to DistributedDataParallel, as in `wrap`.
        return LightningDDPStrategy(
            process_group_backend=runtime.backend_for(self.device.type),
            bucket_cap_mb=self.config.bucket_cap_mb,
            find_unused_parameters=self.config.find_unused_parameters,
        )

    @contextlib.contextmanager
    def micro_batch(self, sync: bool) -> Iterator[None]:
        """Skip the all-reduce on all but the last micro-batch (forward included, as DDP needs)."""
        ddp = cast(DistributedDataParallel, self.wrapped)
        with contextlib.nullcontext() if sync else ddp.no_sync():
            yield
