"""The quality gate a trained model must pass before it is registered or promoted.

A workload's config lists its thresholds; the pipeline skeleton checks them against the
held-out metrics and says which ones failed, naming the config field to change.
"""

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Threshold:
    """`metric op value`, e.g. `eval_r2 >= 0.5`; `field` is the config field that sets it."""

    metric: str
    op: Literal[">=", "<="]
    value: float
    field: str

    def failure(self, metrics: Mapping[str, float]) -> str | None:
        """Why `metrics` miss this threshold (a missing or NaN metric misses), else None."""
        got = metrics.get(self.metric, math.nan)
        passed = got >= self.value if self.op == ">=" else got <= self.value
        if passed:
            return None
        broken = "<" if self.op == ">=" else ">"
        return f"{self.metric}={got:.3f} {broken} {self.field}={self.value}"


def gate_failures(thresholds: Iterable[Threshold], metrics: Mapping[str, float]) -> list[str]:
    """Every threshold `metrics` miss, in order; empty when the model passes the gate."""
    return [f for t in thresholds if (f := t.failure(metrics)) is not None]
