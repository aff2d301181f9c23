"""What training keeps per GPU before and after a technique shards it: the technique's part of
the memory estimate (`trainflow.memory` adds activations, logits and the reserve).

Each technique config says how it shards a `Replica` into `States` (`memory_per_gpu`); the
formulas are in `trainflow.memory`'s docstring. Sizes are in bytes per GPU; no torch here.
"""

from dataclasses import dataclass
from typing import Literal

Precision = Literal["fp32", "bf16"]


@dataclass(frozen=True)
class States:
    """Model states per GPU in bytes, and what the technique keeps in host RAM instead."""

    params: float
    grads: float
    optimizer: float
    buffers: float = 0.0  # DDP's gradient buckets, or the units FSDP / ZeRO-3 gather
    host: float = 0.0


@dataclass(frozen=True)
class Replica:
    """One whole copy of the model states, before any technique shards it.

    `layer_units` and `whole_model` are what a sharding technique gathers back on the GPU:
    two decoder layers and the output head (or the whole model), in the compute dtype, with
    their unsharded gradients in the trained share.
    """

    trained: float  # trained parameters: all of them, or a LoRA adapter's
    frozen_weights: float  # bytes of the frozen weights (a LoRA run's base)
    world_size: int
    precision: Precision  # compute precision
    layer_units: float
    whole_model: float

    def states(self, params: int = 4, grads: int = 4, optimizer: int = 8) -> States:
        """The unsharded states at these bytes per trained parameter (fp32 Adam: 4, 4, 8)."""
        return States(
            params=self.trained * params + self.frozen_weights,
            grads=self.trained * grads,
            optimizer=self.trained * optimizer,
        )
