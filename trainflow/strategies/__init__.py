"""Training techniques behind one interface, registered by name.

    strategy = build_strategy(FSDPConfig())        # or DDPConfig(), DeepSpeedConfig(zero_stage=3)
    model, optimizer = strategy.wrap(model, OptimizerConfig(), micro_batch_size=8,
                                     grad_accum_steps=1)

Adding a technique: a config class in `config.py` (joined to `TechniqueConfig`), a `Strategy`
subclass in its own module, and one line in `STRATEGIES`.
"""

from trainflow.strategies.base import Strategy, find_blocks
from trainflow.strategies.config import (
    DDPConfig,
    DeepSpeedConfig,
    FSDPConfig,
    OptimizerConfig,
    TechniqueConfig,
    deepspeed_json,
)
from trainflow.strategies.ddp import DDPStrategy
from trainflow.strategies.deepspeed import DeepSpeedStrategy
from trainflow.strategies.fsdp import FSDPStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "deepspeed": DeepSpeedStrategy,
}


def build_strategy(config: TechniqueConfig) -> Strategy:
    """The strategy registered under `config.name`, configured by `config`."""
    return STRATEGIES[config.name](config)


__all__ = [
    "STRATEGIES",
    "DDPConfig",
    "DeepSpeedConfig",
    "FSDPConfig",
    "OptimizerConfig",
    "Strategy",
    "TechniqueConfig",
    "build_strategy",
    "deepspeed_json",
    "find_blocks",
]
