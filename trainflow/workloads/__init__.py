"""Workloads: what runs on the ranks, how it is evaluated and how its model is registered.

A workload is a module with its config in `trainflow.configs` and these functions, all plain
torch (no Prefect):

    build_model(job) -> nn.Module              # built on the meta device before launch
    train(job, strategy, *, output_dir, mlflow_run_id, resume_from) -> TrainResult   # each rank
    evaluate(job, trained) -> Evaluation       # held-out metrics, the trained model loaded once
    log_model(job, evaluation, run_id, name, tags) -> str   # MLflow version

A workload whose ranks evaluate and log the model themselves, after training, returns the
metrics and the logged model in `TrainResult.evaluation`; the pipeline then only registers it
(SFT does: the pipeline's process never loads the model). One whose checks need its libraries
can have a launch's standby agent run them ahead (`record_checked_ahead`).

`job` is the workload's config, or a model carrying it with what the pipeline prepared (the
SFT job adds its dataset). A workload is registered as part of its pipeline's spec
(`trainflow.pipelines.PIPELINES`).

This package imports nothing heavy: the registry is read before any rank starts.
"""

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

Framework = Literal["torch", "hf", "lightning"]


@dataclass(frozen=True)
class WorkloadSpec:
    """A registered workload.

    Attributes:
        name: Pipeline name: MLflow outputs folder, artifact keys and task names use it.
        module: Import path of the workload module (imported on first use).
        framework: What applies the technique on the ranks: our own loop over
            `Strategy.wrap` ("torch"), the Hugging Face Trainer ("hf") or Lightning.
        title: How people call it, in summaries ("MLP", "SFT").
        alias: None registers a version only past the gate; a name ("champion") registers
            every finished run and moves that alias only past the gate.
    """

    name: str
    module: str
    framework: Framework
    title: str
    alias: str | None = None

    def ref(self, attr: str) -> str:
        """`module:attr`, the import string a rank resolves."""
        return f"{self.module}:{attr}"

    def load(self) -> ModuleType:
        """The workload module (imports torch and friends)."""
        return importlib.import_module(self.module)


@dataclass
class Evaluation:
    """Held-out metrics, and what registration needs from the same pass: the trained model
    they were computed on and, where the workload takes it from the held-out data, an input
    example. `model_dir` is the folder the trained model was loaded from (a full model or an
    adapter): registration logs it as it is when it holds exactly that model, and otherwise
    saves the model beside it, on the run's disk rather than the temp disk."""

    metrics: dict[str, float]
    model: Any = field(default=None, repr=False)
    input_example: Any = field(default=None, repr=False)
    model_dir: Path | None = None
    logged_model_uri: str | None = None  # already logged to the run (by rank 0): register it


# Configs whose workload checks (the ones needing its libraries) passed ahead, in the process
# that had them loaded: a launch's standby agent (`trainflow.launch.backends.standby`).
_checked_ahead: set[tuple[str, str]] = set()


def record_checked_ahead(workload: str, config: Any) -> None:
    """`config` passed `workload`'s checks ahead (its `check_config`, and the technique on its
    model built on the meta device): this process need not import the workload to run them
    again (`checked_ahead`)."""
    _checked_ahead.add((workload, config.model_dump_json()))


def checked_ahead(workload: str, config: Any) -> bool:
    """Whether `config`, exactly, passed `workload`'s checks ahead (`record_checked_ahead`)."""
    return (workload, config.model_dump_json()) in _checked_ahead
