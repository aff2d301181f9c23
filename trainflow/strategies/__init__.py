"""Training techniques behind one interface, registered by name.

    strategy = build_strategy(FSDPConfig())        # or DDPConfig(), DeepSpeedConfig(zero_stage=3)
    model, optimizer = strategy.wrap(model, OptimizerConfig(), micro_batch_size=8,
                                     grad_accum_steps=1)

Adding a technique: a `Technique` config class and a `Strategy` subclass (one module will do),
and one call, `register_technique(ToyConfig, "my_package.toy:ToyStrategy")`
(`trainflow.strategies.technique`). Every `TechniqueConfig` field, the technique subflows
(`flows/techniques`), `build_strategy` and the memory plan read the registry.

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
    Technique,
    check_framework,
    deepspeed_json,
)
from trainflow.strategies.technique import (
    STRATEGIES,
    TECHNIQUES,
    register_technique,
    technique_class,
    technique_union,
)

if TYPE_CHECKING:
    from trainflow.strategies.base import Strategy, find_blocks
    from trainflow.strategies.config import TechniqueConfig


def strategy_class(name: str) -> "type[Strategy]":
    """The strategy class registered under technique `name`."""
    technique_class(name)  # refuses an unknown name, listing the known ones
    module, _, attr = STRATEGIES[name].partition(":")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


def build_strategy(config: Technique) -> "Strategy":
    """The strategy registered under `config.name`, configured by `config`."""
    return strategy_class(config.name)(config)


def __getattr__(name: str) -> Any:
    if name in ("Strategy", "find_blocks"):
        return getattr(importlib.import_module("trainflow.strategies.base"), name)
    if name == "TechniqueConfig":  # the techniques registered by now
        return technique_union()
    raise AttributeError(f"module 'trainflow.strategies' has no attribute {name!r}")


__all__ = [
    "STRATEGIES",
    "TECHNIQUES",
    "DDPConfig",
    "DeepSpeedConfig",
    "FSDPConfig",
    "OptimizerConfig",
    "Strategy",
    "Technique",
    "TechniqueConfig",
    "build_strategy",
    "check_framework",
    "deepspeed_json",
    "find_blocks",
    "register_technique",
    "strategy_class",
    "technique_class",
]
