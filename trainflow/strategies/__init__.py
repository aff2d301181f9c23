"""Training techniques behind one interface, registered by name.

    strategy = build_strategy(FSDPConfig())        # or DDPConfig(), DeepSpeedConfig(zero_stage=3)
    model, optimizer = strategy.wrap(model, OptimizerConfig(), micro_batch_size=8,
                                     grad_accum_steps=1)

Adding a technique: a config class in `config.py` (joined to `TechniqueConfig`), a `Strategy`
subclass in its own module, and one line in `STRATEGIES`. The technique subflows
(`flows/techniques`) are made from this registry.

This package imports no torch until a strategy is built: the configs and the registry's names
are read by `--help`, Prefect's parameter validation and `prefect deploy`.
"""

import importlib
from typing import TYPE_CHECKING, Any

from trainflow.strategies.config import (
    DDPConfig,
    DeepSpeedConfig,
    FSDPConfig,
    OptimizerConfig,
    TechniqueConfig,
    check_framework,
    deepspeed_json,
)

if TYPE_CHECKING:
    from trainflow.strategies.base import Strategy, find_blocks

# Technique name -> "module:Class" of its strategy, imported when a rank builds it.
STRATEGIES: dict[str, str] = {
    "ddp": "trainflow.strategies.ddp:DDPStrategy",
    "fsdp": "trainflow.strategies.fsdp:FSDPStrategy",
    "deepspeed": "trainflow.strategies.deepspeed:DeepSpeedStrategy",
}


def strategy_class(name: str) -> "type[Strategy]":
    """The strategy class registered under technique `name`."""
    if name not in STRATEGIES:
        raise ValueError(f"technique {name!r} is not registered; known: {sorted(STRATEGIES)}")
    module, _, attr = STRATEGIES[name].partition(":")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


def build_strategy(config: TechniqueConfig) -> "Strategy":
    """The strategy registered under `config.name`, configured by `config`."""
    return strategy_class(config.name)(config)


def __getattr__(name: str) -> Any:
    if name in ("Strategy", "find_blocks"):
        return getattr(importlib.import_module("trainflow.strategies.base"), name)
    raise AttributeError(f"module 'trainflow.strategies' has no attribute {name!r}")


__all__ = [
    "STRATEGIES",
    "DDPConfig",
    "DeepSpeedConfig",
    "FSDPConfig",
    "OptimizerConfig",
    "Strategy",
    "TechniqueConfig",
    "build_strategy",
    "check_framework",
    "deepspeed_json",
    "find_blocks",
    "strategy_class",
]
