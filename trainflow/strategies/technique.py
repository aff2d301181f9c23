"""What every technique config is, and the registry of techniques by name.

A technique is a pydantic config class (a subclass of `Technique`, with `name: Literal[...]`)
and a strategy class that applies it inside the ranks, named by import path so that reading a
config imports no torch:

    register_technique(ToyConfig, "my_package.toy:ToyStrategy")

From then on, in this process, the technique is a variant of every config field typed
`TechniqueConfig` (the command line's `--technique`, the Prefect form, deployments), it has a
technique subflow (`flows/techniques`), `build_strategy` builds it and the memory plan
estimates it. Register at import of the module that defines the config, so that a rank,
which imports that module to unpickle the config, has it registered too.

A pipeline config asks a technique what it does (`precision_option`, `checkpointing_option`,
`keeps_master_weights`, `memory_per_gpu`), never which class it is.
"""

import functools
import graphlib
import operator
from abc import abstractmethod
from collections.abc import Iterator
from typing import Annotated, Any, ClassVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

from trainflow.errors import FrameworkError
from trainflow.strategies.footprint import Precision, Replica, States

__all__ = [
    "FRAMEWORKS",
    "STRATEGIES",
    "TECHNIQUES",
    "Precision",
    "Technique",
    "check_framework",
    "register_technique",
    "technique_class",
    "technique_union",
]

# Framework name -> how messages name it.
FRAMEWORKS: dict[str, str] = {
    "torch": "trainflow's own loop",
    "hf": "the Hugging Face Trainer",
    "lightning": "the Lightning Trainer",
}


class Technique(BaseModel):
    """The base of every technique config: what pipelines, checks and the estimate ask of it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # Each technique narrows it to its own `Literal["..."]`: the union's discriminator.
    name: str = Field(description="Technique name.")

    # The frameworks the technique's strategy has settings for (`trainflow.strategies.frameworks`).
    frameworks: ClassVar[tuple[str, ...]] = tuple(FRAMEWORKS)
    # The option that sets the technique's own compute precision, if it has one: a pipeline's
    # `precision` goes into it.
    precision_option: ClassVar[str | None] = None
    # The option that makes the technique recompute activations itself, if it has one: a
    # pipeline's gradient checkpointing becomes it.
    checkpointing_option: ClassVar[str | None] = None
    # True when the technique keeps fp32 master weights of its own (sharded or in its
    # optimizer), so the weights may be loaded in bf16.
    keeps_master_weights: ClassVar[bool] = False

    @property
    def precision(self) -> Precision | None:
        """The compute precision the technique sets itself, or None when it sets none."""
        return None if self.precision_option is None else getattr(self, self.precision_option)

    @property
    def checkpoints_activations(self) -> bool:
        """Whether the technique recomputes activations itself."""
        option = self.checkpointing_option
        return option is not None and bool(getattr(self, option))

    @abstractmethod
    def memory_per_gpu(self, replica: Replica) -> States:
        """The model states each GPU keeps when this technique shards `replica`."""

    def check_world_size(self, world_size: int) -> None:
        """Raise `ValueError` if the technique cannot run on `world_size` ranks."""

    def framework_problem(self, framework: str, *, device_type: str | None = None) -> str | None:
        """Why this technique cannot run under `framework`, or None when it can.

        Args:
            framework: "torch", "hf" or "lightning".
            device_type: "cuda" or "cpu" when known; None skips the checks that depend on it.
        """
        if framework not in FRAMEWORKS:
            return f"unknown framework; known: {', '.join(FRAMEWORKS)}"
        if framework not in self.frameworks:
            return (
                f"the technique has no settings for it; it runs under {', '.join(self.frameworks)}"
            )
        return self._framework_problem(framework, device_type)

    def _framework_problem(self, framework: str, device_type: str | None) -> str | None:
        return None

    def describe(self) -> str:
        """The name and the options that differ from their defaults: `fsdp (replicate_degree=2)`."""
        changed = [
            f"{key}={getattr(self, key)!r}"
            for key, field in type(self).model_fields.items()
            if key != "name" and getattr(self, key) != field.default
        ]
        return f"{self.name} ({', '.join(changed)})" if changed else self.name


def check_framework(
    technique: Technique, framework: str, *, device_type: str | None = None
) -> None:
    """Fail, before any rank starts, if `framework` cannot run `technique`.

    Args:
        technique: The technique config.
        framework: "torch" (our loop), "hf" (Hugging Face Trainer) or "lightning".
        device_type: "cuda" or "cpu" when known; None skips the checks that depend on it.

    Raises:
        FrameworkError: naming the technique (with its changed options), the framework and why.
    """
    problem = technique.framework_problem(framework, device_type=device_type)
    if problem is not None:
        where = FRAMEWORKS.get(framework, f"framework {framework!r}")
        raise FrameworkError(
            f"technique {technique.describe()} cannot run under {where}: {problem}"
        )


# Technique name -> its config class, and -> "module:Class" of its strategy (imported by the
# rank that builds it). Both in registration order.
TECHNIQUES: dict[str, type[Technique]] = {}
STRATEGIES: dict[str, str] = {}

UNION_DESCRIPTION = "Parallelism technique and its options."


def register_technique(config: type[Technique], strategy: str) -> None:
    """Make `config` a technique, applied in the ranks by the strategy class at `strategy`.

    Every model class already built with a technique field gets the new variant (and is
    rebuilt, with the models that hold it); fields typed later get it from `technique_union`.
    A class of the same module and name registered again (its module imported again)
    replaces the one before.

    Args:
        config: A `Technique` subclass with a `name: Literal["..."]` field.
        strategy: "module:Class" of its `trainflow.strategies.Strategy` subclass.

    Raises:
        ValueError: the class is no technique, the path no import path, or the name is taken.
    """
    if not (isinstance(config, type) and issubclass(config, Technique)):
        raise ValueError(f"{config!r} is not a subclass of trainflow.strategies.Technique")
    names = (
        get_args(config.model_fields["name"].annotation) if "name" in config.model_fields else ()
    )
    if len(names) != 1 or not isinstance(names[0], str):
        raise ValueError(f"{config.__name__} needs a field name: Literal['<technique name>']")
    module, sep, attr = strategy.partition(":")
    if not (module and sep and attr):
        raise ValueError(f"strategy {strategy!r} is not an import path of the form module:Class")
    name = names[0]
    known = TECHNIQUES.get(name)
    if known is not None and _qualname(known) != _qualname(config):
        raise ValueError(f"technique {name!r} is already registered as {_qualname(known)}")
    TECHNIQUES[name] = config
    STRATEGIES[name] = strategy
    if known is not config:
        _add_to_models()


def technique_class(name: str) -> type[Technique]:
    """The config class registered under technique `name`."""
    if name not in TECHNIQUES:
        raise ValueError(f"technique {name!r} is not registered; known: {sorted(TECHNIQUES)}")
    return TECHNIQUES[name]


def technique_union(*others: type[BaseModel], description: str = UNION_DESCRIPTION) -> Any:
    """The registered techniques (then `others`) as a union discriminated on `name`.

    Use it as a field's type; a technique registered later is added to the field then.
    """
    union = functools.reduce(operator.or_, [*TECHNIQUES.values(), *others])
    return Annotated[union, Field(discriminator="name", description=description)]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _is_technique(member: Any) -> bool:
    return isinstance(member, type) and issubclass(member, Technique)


def _registered(member: Any) -> Any:
    """The class registered under the name of technique `member` (itself, or a newer copy)."""
    if not _is_technique(member):
        return member
    return TECHNIQUES.get(get_args(member.model_fields["name"].annotation)[0], member)


def _models() -> Iterator[type[BaseModel]]:
    seen: set[type] = set()
    stack = list(BaseModel.__subclasses__())
    while stack:
        model = stack.pop()
        if model not in seen:
            seen.add(model)
            stack.extend(model.__subclasses__())
            yield model


def _mentions(annotation: Any, models: set[type[BaseModel]]) -> bool:
    if isinstance(annotation, type) and annotation in models:
        return True
    return any(_mentions(arg, models) for arg in get_args(annotation))


def _fields(model: type[BaseModel]) -> Iterator[FieldInfo]:
    yield from getattr(model, "__pydantic_fields__", {}).values()


def _add_to_models() -> None:
    """Give every technique field the registered techniques it lacks, and rebuild its model
    and the models that hold that one (a model keeps the validators of the models inside it)."""
    models = list(_models())
    changed: set[type[BaseModel]] = set()
    for model in models:
        for info in _fields(model):
            members = get_args(info.annotation) if get_origin(info.annotation) else ()
            if info.discriminator == "name" and any(_is_technique(m) for m in members):
                current = [_registered(m) for m in members]
                # Appended: the variants already listed keep their order (the help text).
                current += [t for t in TECHNIQUES.values() if t not in current]
                if current != list(members):
                    info.annotation = functools.reduce(operator.or_, current)
                    changed.add(model)
    stale = set(changed)
    while outer := {
        m
        for m in models
        if m not in stale and any(_mentions(i.annotation, stale) for i in _fields(m))
    }:
        stale |= outer
    # Inner models first: a model's validator is built from those of the models it holds.
    inner = {
        m: {d for d in stale - {m} if any(_mentions(i.annotation, {d}) for i in _fields(m))}
        for m in stale
    }
    for model in graphlib.TopologicalSorter(inner).static_order():
        if model.__pydantic_complete__:
            model.model_rebuild(force=True)
