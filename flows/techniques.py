"""Technique subflows, one per registered technique; a pipeline picks one by `technique.name`.

    trained = techniques[config.technique.name](
        workload=workload, technique=config.technique, resources=config.resources)

Each subflow takes its own technique config type (the Prefect UI shows that technique's
options), checks before launch that the technique can train the workload under its framework,
and launches the ranks. `techniques` reads the registry (`trainflow.strategies.TECHNIQUES`)
each time it is asked, so a technique registered after this module was imported has its
subflow too, and adding a technique needs no change here.
"""

from collections.abc import Iterator, Mapping
from typing import Any

from prefect import Flow, flow

from tasks.techniques import train_with_technique
from trainflow.resources import Resources
from trainflow.strategies import TECHNIQUES, Technique
from trainflow.strategies.job import TrainResult, Workload


def _subflow(name: str, config_type: type[Technique]) -> Flow[..., TrainResult]:
    def subflow(workload: Workload, technique: Any, resources: Resources) -> TrainResult:
        return train_with_technique(workload, technique, resources)

    subflow.__annotations__["technique"] = config_type
    subflow.__name__ = subflow.__qualname__ = name
    summary = (config_type.__doc__ or name).strip().splitlines()[0]
    subflow.__doc__ = f"Train `workload` on `resources` with {summary}"
    return flow(name=name, log_prints=True)(subflow)


class _Subflows(Mapping[str, Flow[..., TrainResult]]):
    """Technique name -> its subflow, made the first time it is asked for."""

    def __init__(self) -> None:
        self._made: dict[str, tuple[type[Technique], Flow[..., TrainResult]]] = {}

    def __getitem__(self, name: str) -> Flow[..., TrainResult]:
        config_type = TECHNIQUES[name]  # KeyError for a name not registered
        made = self._made.get(name)
        if made is None or made[0] is not config_type:
            made = self._made[name] = (config_type, _subflow(name, config_type))
        return made[1]

    def __iter__(self) -> Iterator[str]:
        return iter(list(TECHNIQUES))

    def __len__(self) -> int:
        return len(TECHNIQUES)


techniques: Mapping[str, Flow[..., TrainResult]] = _Subflows()
