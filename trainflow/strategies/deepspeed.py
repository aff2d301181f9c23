"""DeepSpeed ZeRO 1/2/3: the engine owns backward, step and checkpoints.

On CPU DeepSpeed picks its CPU accelerator and uses the gloo group already initialised;
`deepspeed_json` selects torch's AdamW there, as DeepSpeed's fused and CPU Adam need compiled
ops. DeepSpeed is imported on the rank only, when `wrap` runs.
"""

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from trainflow import runtime
from trainflow.strategies.base import Strategy
from trainflow.strategies.config import DeepSpeedConfig, OptimizerConfig, deepspeed_json


class DeepSpeedStrategy(Strategy):
    """`deepspeed.initialize` with a JSON config built from `DeepSpeedConfig`."""

    name = "deepspeed"
    config: DeepSpeedConfig

    def wrap(
        self,
        model: nn.Module,
        optimizer: OptimizerConfig,
        *,
        micro_batch_size: int,
        grad_accum_steps: int,
    ) -> tuple[nn.Module, Any]:
        import deepspeed
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
        if self.device.type == "cpu":
            # No DeepSpeed op is needed on CPU (torch's AdamW, gloo). Saying none is available
            # stops each rank probing compilers for every op (~10 s) and JIT-building a
            # shared-memory all-reduce (minutes on a cold cache).
            deepspeed.ops.__compatible_ops__ = {}
        ds_config = deepspeed_json(
            self.config,
            micro_batch_size=micro_batch_size,
            grad_accum_steps=grad_accum_steps,
            world_size=runtime.get_world_size(),
            optimizer=optimizer,
            device_type=self.device.type,
        )
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config
        )
        self.model, self.optimizer = engine, ds_optimizer
        return engine, ds_optimizer

    @property
    def engine(self) -> Any:
        """The DeepSpeed engine `wrap` returned."""
        return self.wrapped

    def backward(self, loss: Any) -> None:
        """The engine's backward: ZeRO reduces and partitions gradients in its hooks."""
        self.engine.backward(loss, scale_wrt_gas=False)

    @contextlib.contextmanager
    def micro_batch(self, sync: bool) -> Iterator[None]:
        """DeepSpeed counts micro-batches itself: a non-final one ends with a counting step."""
        yield
        if not sync:
            self.engine.step()

    def step(self) -> None:
        """The engine's step at the accumulation boundary (it also clears the gradients)."""
        self.engine.step()

    def _save(self, path: Path) -> None:
        self.engine.save_checkpoint(str(path.parent), tag=path.name, save_latest=False)

    def _load(self, path: Path) -> None:
        load_path, _ = self.engine.load_checkpoint(str(path.parent), tag=path.name)
        if load_path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint in {path}")

    def export(self, path: Path) -> None:
        """Gather the weights (ZeRO-3 partitions included) into one file written by rank 0."""
        self.engine.save_16bit_model(str(path.parent), path.name)
        dist.barrier()
