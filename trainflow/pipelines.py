"""Every pipeline, registered once: its config and presets, workload, data, gate and deployments.

A `PipelineSpec` is the design card of a pipeline as data. The flow in `flows/<name>.py` is the
chain of steps (prepare -> technique subflow -> evaluate -> register); everything else the
command line, sweeps, `--dry-run`, deployments and the docs need is read from here:

    spec = PIPELINES["sft"]
    spec.defaults()                  # the default preset, validated
    spec.preset("gpt-oss-120b")      # trainflow/presets/sft/gpt-oss-120b.yaml, validated
    spec.workload.load()             # the workload module (imports torch)

Adding a pipeline: its config, its workload module, one entry here, a flow file, and its
deployments in `prefect.yaml` (`tests/unit/test_pipelines.py` fails until each is there).

This module imports pydantic and nothing heavy: `--help` and deployments read it.
"""

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from trainflow.workloads import WorkloadSpec

PRESETS_ROOT = Path(__file__).resolve().parent / "presets"
Mode = Literal["min", "max"]


@dataclass(frozen=True)
class PipelineSpec:
    """One pipeline.

    Attributes:
        name: The flow's name, `flows/<name>.py`, the MLflow outputs folder and artifact keys.
        title: How people call it, in summaries and docs ("SFT").
        config: `module:Class` of its pydantic config.
        workload: What runs on the ranks (`trainflow.workloads`); None for the pipelines that
            train with another framework's own entry point (`flows/frameworks.py`).
        presets: Folder under `trainflow/presets/` holding its presets (`<preset>.yaml`, a
            whole config each); None: the config class's defaults are its only starting point.
        default_preset: The preset `python -m flows.<name>` and the flow start from.
        summary_metrics: What the command line prints at the end, in order.
        sweep_metric: What a sweep of this pipeline optimises unless told otherwise, and
            `sweep_mode` which way.
        startup: `module` with the pipeline's own start-up hooks, each optional:
            `check_files(config)` (a second, before the Prefect server starts),
            `start_agent(config)` (the training launch's agent, started before the flow's
            module imports Prefect), `deep_check(config)` (while the server starts),
            `command_line(argv)` (the arguments as the options parser reads them),
            `resolve(config)` (the config completed from its files, for `--dry-run`).
            None: the workload's `check_config`, with its launch agent started first.
        checks: `module:function` checking a config without GPUs, network or the training
            libraries (files, names, sizes, the batch against the data's rows): run before
            the Prefect server starts (unless `startup` has `check_files`, which runs instead)
            and by `--dry-run`; a ValueError from it is a usage error.
        preload: Modules the flow's process imports while the Prefect server starts.
        deployments: Deployment name in `prefect.yaml` -> the preset its parameters are (a
            test holds the two equal), or None for a deployment with parameters of its own.
        defaults_factory: `module:function` that, given the pipeline's name, returns its default
            config, for a pipeline whose defaults are neither a preset nor the class's (the
            framework pipelines).
    """

    name: str
    title: str
    config: str
    workload: WorkloadSpec | None
    sweep_metric: str
    sweep_mode: Mode
    summary_metrics: tuple[str, ...] = ()
    presets: str | None = None
    default_preset: str | None = None
    startup: str | None = None
    checks: str | None = None
    preload: tuple[str, ...] = ("mlflow",)
    deployments: Mapping[str, str | None] = field(default_factory=dict)
    defaults_factory: str | None = None

    @property
    def flow_module(self) -> str:
        return f"flows.{self.name}"

    @property
    def entrypoint(self) -> str:
        """The flow as `prefect.yaml` names it."""
        return f"flows/{self.name}.py:{self.name}"

    @property
    def ranks(self) -> WorkloadSpec:
        """The workload, for a pipeline that has one (every one trained by our techniques)."""
        if self.workload is None:
            raise TypeError(f"pipeline {self.name!r} trains with its framework's own entry point")
        return self.workload

    def config_class(self) -> type[BaseModel]:
        module, _, attr = self.config.partition(":")
        cls: type[BaseModel] = getattr(importlib.import_module(module), attr)
        return cls

    def preset_names(self) -> list[str]:
        if self.presets is None:
            return []
        return sorted(p.stem for p in (PRESETS_ROOT / self.presets).glob("*.yaml"))

    def preset_file(self, name: str) -> Path:
        if self.presets is None:
            raise ValueError(f"pipeline {self.name!r} has no presets")
        path = PRESETS_ROOT / self.presets / f"{name}.yaml"
        if not path.is_file():
            raise ValueError(
                f"unknown {self.name} preset {name!r}; known presets: {self.preset_names()}"
            )
        return path

    def preset(self, name: str) -> Any:
        """A shipped preset, validated."""
        data = yaml.safe_load(self.preset_file(name).read_text())
        return self.config_class().model_validate(data)

    def presets_by_name(self) -> dict[str, Callable[[], Any]]:
        """`--preset NAME` choices, each loaded only when chosen."""
        return {name: _Preset(self, name) for name in self.preset_names()}

    def defaults(self) -> Any:
        """The config a run starts from when given nothing."""
        if self.defaults_factory is not None:
            module, _, attr = self.defaults_factory.partition(":")
            return getattr(importlib.import_module(module), attr)(self.name)
        if self.default_preset is not None:
            return self.preset(self.default_preset)
        return self.config_class()()

    def check(self) -> Callable[[Any], None] | None:
        """The pipeline's `checks` function, if it has one."""
        if self.checks is None:
            return None
        module, _, attr = self.checks.partition(":")
        check: Callable[[Any], None] = getattr(importlib.import_module(module), attr)
        return check

    def startup_hook(self, name: str) -> Callable[[Any], Any] | None:
        """The start-up hook `name` of `startup`, if the pipeline has one."""
        if self.startup is None:
            return None
        hook: Callable[[Any], Any] | None = getattr(
            importlib.import_module(self.startup), name, None
        )
        return hook


@dataclass(frozen=True)
class _Preset:
    """A preset loader that pickles and prints as its name (argparse shows the choices)."""

    spec: PipelineSpec
    name: str

    def __call__(self) -> Any:
        return self.spec.preset(self.name)


FRAMEWORK_METRICS = (
    "train_loss",
    "steps",
    "untrained_loss",
    "eval_loss",
    "eval_perplexity",
    "eval_exact_match",
    "train_runtime_s",
)


def _metrics(names: tuple[str, ...], whens: tuple[str, ...] = ("untrained", "eval")) -> tuple:
    return tuple(f"{when}_{name}" for name in names for when in whens)


PIPELINES: dict[str, PipelineSpec] = {
    spec.name: spec
    for spec in (
        PipelineSpec(
            name="mlp",
            title="MLP",
            config="trainflow.configs.mlp:MLPConfig",
            workload=WorkloadSpec("mlp", "trainflow.workloads.mlp", "torch", "MLP"),
            sweep_metric="eval_mse",
            sweep_mode="min",
            deployments={"cpu-local": None, "h100": None},
        ),
        PipelineSpec(
            name="transformer",
            title="Transformer",
            config="trainflow.configs.transformer:TransformerConfig",
            workload=WorkloadSpec(
                "transformer", "trainflow.workloads.transformer", "torch", "Transformer"
            ),
            sweep_metric="eval_loss",
            sweep_mode="min",
            deployments={"cpu-local": None, "h100": None},
        ),
        PipelineSpec(
            name="sft",
            title="SFT",
            config="trainflow.configs.sft:SFTConfig",
            workload=WorkloadSpec("sft", "trainflow.workloads.sft", "hf", "SFT", "champion"),
            sweep_metric="eval_loss",
            sweep_mode="min",
            summary_metrics=_metrics(("loss", "perplexity", "exact_match"))
            + ("train_runtime", "eff_tokens_per_s"),
            presets="sft",
            default_preset="debug_cpu",
            startup="trainflow.workloads.sft_startup",
            checks="trainflow.workloads.sft_checks:check_config",
            preload=(),  # the start-up hooks load what the run needs
            deployments={
                "cpu-local": "debug_cpu",
                "h100": "h100",
                "gpt-oss-20b": "gpt-oss-20b",
                "gpt-oss-120b": "gpt-oss-120b",
                "llama-3.2-1b-zero3": "llama-3.2-1b-zero3",
            },
        ),
        PipelineSpec(
            name="detection",
            title="Detection",
            config="trainflow.configs.detection:DetectionConfig",
            workload=WorkloadSpec(
                "detection", "trainflow.workloads.detection", "torch", "Detection"
            ),
            sweep_metric="eval_map",
            sweep_mode="max",
            summary_metrics=_metrics(("map", "map_50")) + ("train_loss",),
            presets="detection",
            checks="trainflow.workloads.detection_checks:check_config",
            default_preset="debug_cpu",
            deployments={"cpu-local": "debug_cpu", "a10": None, "h100": "gpu"},
        ),
        PipelineSpec(
            name="two_tower",
            title="Two-tower",
            config="trainflow.configs.two_tower:TwoTowerConfig",
            workload=WorkloadSpec(
                "two_tower", "trainflow.workloads.two_tower", "lightning", "Two-tower", "champion"
            ),
            sweep_metric="eval_auroc",
            sweep_mode="max",
            summary_metrics=_metrics(("auroc", "recall_at_10")) + ("train_best_val_auroc",),
            presets="two_tower",
            checks="trainflow.workloads.two_tower_checks:check_config",
            default_preset="debug_cpu",
            deployments={"cpu-local": "debug_cpu", "a10": None, "h100": "gpu"},
        ),
        *(
            PipelineSpec(
                name=name,
                title=title,
                config="trainflow.configs.frameworks:FrameworkConfig",
                workload=None,  # the framework's own entry point, in its own environment
                sweep_metric="eval_loss",
                sweep_mode="min",
                summary_metrics=FRAMEWORK_METRICS,
                startup="trainflow.frameworks.startup",
                defaults_factory="trainflow.frameworks.startup:defaults",
                deployments=deployments,
            )
            for name, title, deployments in (
                ("axolotl", "Axolotl", {"cpu-local": None, "axolotl-olmo3-7b": None}),
                ("llm_foundry", "LLM Foundry", {"cpu-local": None, "llm-foundry-llama-3-8b": None}),
                ("unsloth", "Unsloth", {"cpu-local": None, "unsloth-llama-3.2-3b": None}),
            )
        ),
    )
}


def pipeline(name: str) -> PipelineSpec:
    """The registered pipeline `name`; ValueError naming the known ones."""
    if name not in PIPELINES:
        raise ValueError(f"unknown pipeline {name!r}; known: {', '.join(PIPELINES)}")
    return PIPELINES[name]
