"""The frameworks a technique runs under, each behind one adapter.

Our own loop (framework "torch") talks to the strategy itself: `wrap`, `micro_batch`,
`backward`, `step`. The Hugging Face Trainer ("hf") and the Lightning Trainer ("lightning")
own their loop and take settings instead. A strategy declares only what is its own, one method
per framework (`Strategy.hf_settings`, `Strategy.lightning_settings`); the adapters here do
what every technique shares:

- refuse, before anything is built, a pairing the technique cannot run (`check_framework`,
  the same message as before launch);
- the Trainer's device and process-group backend, and the environment accelerate reads;
- Lightning's view of the launched ranks (`TorchElasticEnvironment`).

Both run inside ranks the launcher started: they read the torchelastic environment and the
process group already open, and start no process of their own.
"""

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from trainflow import runtime
from trainflow.strategies.config import OptimizerConfig
from trainflow.strategies.technique import check_framework

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy


@dataclass(frozen=True)
class Batches:
    """The batches and optimizer of a run, which some techniques' settings repeat (DeepSpeed's
    JSON)."""

    micro_batch_size: int  # samples per rank per micro-batch
    grad_accum_steps: int  # micro-batches per optimizer step
    optimizer: OptimizerConfig


@dataclass(frozen=True)
class HFSettings:
    """A technique as the Hugging Face Trainer takes it."""

    args: dict[str, Any]  # `TrainingArguments` settings
    # Variables accelerate reads (transformers 4 passed FSDP's settings only through them).
    environ: dict[str, str] = field(default_factory=dict)


class Declaring(Protocol):
    """What the adapters read of a strategy (`trainflow.strategies.Strategy`)."""

    config: Any  # the technique config
    device: Any  # this rank's torch.device

    def hf_settings(
        self, batches: Batches, *, layer_classes: list[str], device_type: str
    ) -> HFSettings: ...

    def lightning_settings(self, batches: Batches) -> "ParallelStrategy": ...


def hf_trainer_args(
    strategy: Declaring, batches: Batches, *, layer_classes: list[str], device_type: str
) -> dict[str, Any]:
    """The Hugging Face adapter: `TrainingArguments` settings that apply `strategy`'s technique.

    Raises:
        FrameworkError: the Hugging Face Trainer cannot run this technique.
    """
    check_framework(strategy.config, "hf", device_type=device_type)
    settings = strategy.hf_settings(batches, layer_classes=layer_classes, device_type=device_type)
    os.environ.update(settings.environ)
    args: dict[str, Any] = {"use_cpu": device_type != "cuda"}
    if runtime.get_world_size() > 1:
        args["ddp_backend"] = runtime.backend_for(device_type)
    return args | settings.args


def lightning_strategy(strategy: Declaring, batches: Batches) -> "ParallelStrategy":
    """The Lightning adapter: the Lightning `Strategy` that applies `strategy`'s technique in the
    launched ranks, reusing their process group.

    Raises:
        FrameworkError: Lightning cannot run this technique (on this device).
    """
    check_framework(strategy.config, "lightning", device_type=strategy.device.type)
    from lightning.pytorch.plugins.environments import TorchElasticEnvironment

    built = strategy.lightning_settings(batches)
    # ModelParallelStrategy takes no environment argument; every parallel strategy has the
    # attribute, and the Trainer keeps one already set.
    built.cluster_environment = TorchElasticEnvironment()
    return built
