"""What a technique subflow launches: a workload, the ranks it needs, and what comes back.

Only these small pydantic values cross the process boundary; each rank builds its data and
model itself. The module imports no torch: the orchestrator reads it before any rank starts.
"""

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SerializeAsAny,
    WithJsonSchema,
)

from trainflow.resources import Resources
from trainflow.strategies.config import Technique, check_framework

__all__ = [
    "RankEvaluation",
    "Resources",
    "TrainResult",
    "Workload",
    "check_before_launch",
    "check_technique",
    "local_path",
    "run_on_rank",
]


class FunctionRef:
    """A function named by its import path (`module:function`), imported when first called.

    The orchestrator builds a `Workload` without importing the workload's module (torch,
    transformers: seconds); the ranks, which call it, import it. A function given as an object
    is kept as it is and named by its module and qualified name.
    """

    def __init__(self, path: str, function: Callable[..., Any] | None = None):
        module, sep, name = path.partition(":")
        if not sep or not module or not name:
            raise ValueError(f"{path!r} is not an import path of the form module:function")
        self.path = path
        self._function = function

    @classmethod
    def of(cls, value: Any) -> "FunctionRef":
        if isinstance(value, FunctionRef):
            return value
        if isinstance(value, str):
            return cls(value if ":" in value else _colon_path(value))
        if callable(value):
            # A callable object without a name of its own (a `functools.partial`) cannot be
            # imported by path either: it travels as itself.
            module = getattr(value, "__module__", None) or "__main__"
            name = getattr(value, "__qualname__", None) or f"<locals>.{type(value).__name__}"
            return cls(f"{module}:{name}", value)
        raise ValueError(f"expected a function or its import path, got {value!r}")

    def resolve(self) -> Callable[..., Any]:
        if self._function is None:
            module, _, name = self.path.partition(":")
            target: Any = importlib.import_module(module)
            for part in name.split("."):
                target = getattr(target, part)
            self._function = target
        return self._function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        # One defined in `__main__` or inside another function cannot be imported by a rank:
        # it travels as itself (by value); any other as its path.
        if self._function is not None and (
            self.path.startswith("__main__:") or "<locals>" in self.path
        ):
            return (FunctionRef, (self.path, self._function))
        return (FunctionRef, (self.path,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FunctionRef) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    def __repr__(self) -> str:
        return f"FunctionRef({self.path!r})"


def _colon_path(dotted: str) -> str:
    """`package.module.function` -> `package.module:function` (pydantic's ImportString form)."""
    module, _, name = dotted.rpartition(".")
    return f"{module}:{name}" if module else dotted


Function = Annotated[
    FunctionRef,
    BeforeValidator(FunctionRef.of),
    PlainSerializer(lambda ref: ref.path, return_type=str),
    WithJsonSchema({"type": "string", "description": "module:function"}),
]


class Workload(BaseModel):
    """A training function every rank runs, the model it trains, its config and its outputs.

    `train_fn(config, strategy, output_dir=..., mlflow_run_id=..., resume_from=...)` must
    return a `TrainResult`; `model_fn(config)` builds the model (the subflow builds it on the
    meta device to check the technique fits before launching).
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    train_fn: Function = Field(description="Import path module:function of the train loop.")
    model_fn: Function = Field(description="Import path module:function building the model.")
    config: SerializeAsAny[BaseModel] = Field(description="The workload's own config.")
    output_dir: str = Field(description="Folder for checkpoints and the exported model.")
    framework: Literal["torch", "hf", "lightning"] = Field(
        default="torch",
        description="What applies the technique on the ranks: our loop, the Hugging Face "
        "Trainer or Lightning.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="Process-group backend; auto is nccl on GPUs, else gloo."
    )
    mlflow_run_id: str | None = Field(
        default=None, description="MLflow run rank 0 logs metrics to."
    )
    resume_from: str | None = Field(
        default=None, description="A checkpoint folder, or a folder of them (the latest is used)."
    )
    checked_ahead: bool = Field(
        default=False,
        description="The technique was already checked on this model (a launch agent built it "
        "on the meta device ahead): the subflow does not build it again before launch.",
    )


class TrainResult(BaseModel):
    """What training produced: small values and URIs, never tensors."""

    technique: str = Field(description="Technique that trained the model.")
    world_size: int = Field(description="Ranks that trained it.")
    wrapped_as: str = Field(
        description="Class of the model as trained: the technique's wrapper (e.g. "
        "DistributedDataParallel, FSDPLlamaForCausalLM, DeepSpeedEngine)."
    )
    steps: int = Field(description="Optimizer steps reached.")
    metrics: dict[str, float] = Field(description="Training metrics (train_*) at the end.")
    history: dict[int, dict[str, float]] = Field(description="Logged metrics by step.")
    checkpoint_uri: str | None = Field(description="Last checkpoint written (file URI).")
    model_uri: str = Field(description="The trained model: a file or folder URI.")
    evaluation: "RankEvaluation | None" = Field(
        default=None,
        description="Held-out metrics and the logged model, when the ranks evaluated the "
        "model themselves after training (the pipeline then only registers it).",
    )


class RankEvaluation(BaseModel):
    """What rank 0 found and logged after training: the pipeline's process loads no model."""

    metrics: dict[str, float] = Field(description="Held-out metrics (eval_*, untrained_*).")
    logged_model_uri: str | None = Field(
        default=None, description="The model as logged to the MLflow run, to be registered."
    )


def local_path(uri: str) -> Path:
    """The local path of a `file://` URI."""
    return Path(uri.removeprefix("file://"))


def check_before_launch(workload: Workload, technique: Technique, resources: Resources) -> None:
    """Fail in the caller, before any rank starts, if the technique cannot train the workload.

    A workload `checked_ahead` (by a launch agent, on the same model and technique) is not
    built on the meta device again here.

    Raises:
        ValueError: naming the technique field, the framework, or the model that does not fit.
    """
    check_technique(
        lambda: workload.model_fn(workload.config),
        technique,
        resources,
        workload.framework,
        build=not workload.checked_ahead,
    )


def check_technique(
    build_model: Callable[[], Any],
    technique: Technique,
    resources: Resources,
    framework: str,
    *,
    build: bool = True,
) -> None:
    """The technique can train the model `build_model` returns (built on the meta device:
    no weights, no memory) under `framework`, on the ranks of `resources`.

    Raises:
        ValueError: naming the technique field, the framework, or the model that does not fit.
    """
    plan = resources.launch_plan()
    check_framework(technique, framework, device_type=plan.device)
    technique.check_world_size(resources.gpus)
    if not build:
        return
    import torch

    from trainflow.strategies import build_strategy

    with torch.device("meta"):
        model = build_model()
    build_strategy(technique).check_model(model)


def run_on_rank(workload: Workload, technique: Technique) -> Any:
    """Rank entry point: open the process group, build the strategy, run the workload."""
    from trainflow import runtime
    from trainflow.strategies import build_strategy

    backend = None if workload.backend == "auto" else workload.backend
    with runtime.process_group(backend):
        return workload.train_fn(
            workload.config,
            build_strategy(technique),
            output_dir=workload.output_dir,
            mlflow_run_id=workload.mlflow_run_id,
            resume_from=workload.resume_from,
        )
