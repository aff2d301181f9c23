"""Technique subflows, one per registered strategy; a pipeline picks one by `technique.name`.

    trained = techniques[config.technique.name](
        workload=workload, technique=config.technique, resources=config.resources)

Each subflow takes its own technique config type (the Prefect UI shows that technique's
options), checks before launch that the technique can train the workload under its framework,
and launches the ranks. They are made from `trainflow.strategies.STRATEGIES`, so adding a
technique needs no change here.
"""

from typing import Any, get_args

from prefect import Flow, flow

from tasks.techniques import train_with_technique
from trainflow.resources import Resources
from trainflow.strategies import STRATEGIES, TechniqueConfig
from trainflow.strategies.job import TrainResult, Workload


def _technique_configs() -> dict[str, type]:
    """Technique name -> its config class, from the `TechniqueConfig` union."""
    union = get_args(TechniqueConfig)[0]
    return {get_args(cls.model_fields["name"].annotation)[0]: cls for cls in get_args(union)}


def _subflow(name: str, config_type: type) -> Flow[..., TrainResult]:
    def subflow(workload: Workload, technique: Any, resources: Resources) -> TrainResult:
        return train_with_technique(workload, technique, resources)

    subflow.__annotations__["technique"] = config_type
    subflow.__name__ = subflow.__qualname__ = name
    summary = (config_type.__doc__ or name).strip().splitlines()[0]
    subflow.__doc__ = f"Train `workload` on `resources` with {summary}"
    return flow(name=name, log_prints=True)(subflow)


_configs = _technique_configs()
if set(_configs) != set(STRATEGIES):
    raise RuntimeError(
        f"technique configs {sorted(_configs)} and strategies {sorted(STRATEGIES)} disagree"
    )

techniques: dict[str, Flow[..., TrainResult]] = {
    name: _subflow(name, config_type) for name, config_type in _configs.items()
}
