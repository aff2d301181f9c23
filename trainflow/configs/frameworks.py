"""Pipelines that train with another framework's own entry point: Axolotl, LLM Foundry, Unsloth.

Each framework keeps its own config file (its YAML, as its users write it) and trains on our
ranks through its own entry point, in its own virtual environment (`.venvs/NAME`, made by
`bash scripts/setup-framework.sh NAME`): these frameworks pin torch, transformers or trl to
versions the main environment cannot share. The pipeline around it is ours and runs in the
main environment: the data is prepared by our data task, the run is tracked in MLflow, the
trained model is evaluated on our held-out split against the model it started from, and
registered.

The pipeline fills in what it owns in the framework's config (`Framework.overrides`): the base
model, the prepared data, the output folder and, when given, the number of steps. Everything
else (learning rate, LoRA, precision, FSDP or DeepSpeed settings) is the framework's file.

The pipeline is the skeleton every pipeline is made of (`flows/skeleton.py`): a `Framework` is
its workload (`PipelineWorkload`) and stands where a technique would (`FrameworkConfig.technique`);
`FrameworkConfig` has what the skeleton reads (`SkeletonConfig`).
"""

import dataclasses
import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from pydantic import Field, field_validator

from trainflow.configs.base import PipelineConfig
from trainflow.configs.sft import EvaluationSettings, SFTConfig
from trainflow.data import DataConfig
from trainflow.gate import Threshold
from trainflow.launch.spec import LaunchOptions
from trainflow.paths import SafeName
from trainflow.resources import Resources

FrameworkName = Literal["axolotl", "llm-foundry", "unsloth"]
# The main environment's side of a framework run: its evaluation and registration.
PIPELINE_HOOKS = "trainflow.frameworks.pipeline"

REPO_ROOT = Path(__file__).resolve().parents[2]
PRESETS_DIR = Path(__file__).resolve().parents[1] / "presets" / "frameworks"
ENVS_DIR = REPO_ROOT / ".venvs"


@dataclass(frozen=True)
class Framework:
    """A training framework launched its own way, and what the pipeline gives it."""

    name: FrameworkName  # the environment's name: .venvs/NAME, scripts/frameworks/NAME.txt
    title: str
    module: str  # rank side: `train(config_path, overrides) -> dict` on every rank
    data_format: Literal["jsonl", "mds"]  # how it reads the prepared data
    tiny_config: str  # the shipped config that trains a tiny model on CPU ranks
    model_key: tuple[str, ...]  # where its config names the base model
    length_key: tuple[str, ...]  # where its config sets the longest sequence in tokens

    @property
    def flow_module(self) -> str:
        return f"flows.{self.name.replace('-', '_')}"

    def default_python(self) -> Path:
        return ENVS_DIR / self.name / "bin" / "python"

    def setup_command(self) -> str:
        return f"bash scripts/setup-framework.sh {self.name}"

    @property
    def workload(self) -> "FrameworkWorkload":
        return FrameworkWorkload(self)

    def rank_module(self) -> Any:
        return importlib.import_module(self.module)


@dataclass(frozen=True)
class FrameworkWorkload:
    """A framework's pipeline as the skeleton's workload (`flows.skeleton.PipelineWorkload`):
    named after its flow (its outputs folder, artifact keys, `--resume` hint), evaluated and
    registered by `trainflow.frameworks.pipeline`.

    Every finished run is registered; the alias moves to it only past the gate.
    """

    framework: Framework
    alias: str = "champion"

    @property
    def name(self) -> str:
        return self.framework.flow_module.removeprefix("flows.")

    @property
    def title(self) -> str:
        return self.framework.title

    @property
    def module(self) -> str:
        """The rank side: what the launch's agent imports ahead (standard library only)."""
        return self.framework.module

    def load(self) -> ModuleType:
        """The module the skeleton evaluates and registers with (`WorkloadHooks`)."""
        return importlib.import_module(PIPELINE_HOOKS)


FRAMEWORKS: dict[str, Framework] = {
    "axolotl": Framework(
        name="axolotl",
        title="Axolotl",
        module="trainflow.frameworks.axolotl",
        data_format="jsonl",
        tiny_config="axolotl-tiny.yaml",
        model_key=("base_model",),
        length_key=("sequence_len",),
    ),
    "llm-foundry": Framework(
        name="llm-foundry",
        title="LLM Foundry",
        module="trainflow.frameworks.llm_foundry",
        data_format="mds",
        tiny_config="llm-foundry-tiny.yaml",
        model_key=("variables", "model_path"),
        length_key=("variables", "max_seq_len"),
    ),
    "unsloth": Framework(
        name="unsloth",
        title="Unsloth",
        module="trainflow.frameworks.unsloth",
        data_format="jsonl",
        tiny_config="unsloth-tiny.yaml",
        model_key=("model_name",),
        length_key=("max_seq_length",),
    ),
}


class FrameworkConfig(Resources):
    """One framework training run: its own config file, and what the pipeline fills in.

    Not a `PipelineConfig`: the framework's file decides its checkpoints, so there is no
    `--checkpoint-every`, and `--resume` continues the MLflow run but trains from the start.
    """

    framework: FrameworkName | None = Field(
        default=None,
        description="The framework that trains; none: the flow's own (each flow sets its own "
        "and refuses another).",
    )
    framework_config: str = Field(
        description="The framework's own config file (its YAML, as its users write it); the "
        "first positional argument."
    )
    model: str | None = Field(
        default=None,
        description="Base model: tiny-llama (built here from a config with the shipped "
        "tokenizer, no download), a Hugging Face Hub id or a local model folder; replaces the "
        "config file's own. None: the config file's (base_model for Axolotl, model_name for "
        "Unsloth, variables.model_path for LLM Foundry).",
    )
    tokenizer: str | None = Field(
        default=None,
        description="Tokenizer directory or Hub id; none: the shipped one for tiny models, else "
        "the model's.",
    )
    dataset: str = Field(
        default="instructions",
        description="Chat data: a shipped dataset preset, a JSONL file of {'messages': [...]} "
        "rows, or a Hub dataset id; prepared by the data task, then given to the framework.",
    )
    max_length: int | None = Field(
        default=None,
        ge=8,
        description="Longest conversation in tokens (longer ones are left out), replacing the "
        "config file's sequence length; none: the file's.",
    )
    validation_fraction: float = Field(
        default=0.1, gt=0, lt=1, description="Share of the rows held out for evaluation."
    )
    max_steps: int | None = Field(
        default=None,
        ge=1,
        description="Optimizer steps, replacing the config file's own; none keeps the file's.",
    )
    python: str | None = Field(
        default=None,
        description="The framework environment's interpreter; none: .venvs/NAME/bin/python.",
    )
    evaluation: EvaluationSettings = Field(
        default_factory=lambda: EvaluationSettings(
            num_samples=32, batch_size=16, max_new_tokens=8, max_loss_ratio=1.0
        ),
        description="Held-out evaluation and the gate for the champion alias.",
    )
    experiment_name: str = Field(default="frameworks", description="MLflow experiment.")
    registered_model_name: SafeName = Field(
        default="framework-sft", description="MLflow registered model name."
    )
    gpus: int = Field(default=2, ge=1, description="Ranks in total (GPUs, or CPU processes).")
    gpu_type: str | None = Field(
        default="cpu",
        description='GPU type such as "H100"; "cpu" forces CPU ranks; empty: what exists.',
    )
    resume: SafeName | None = Field(
        default=None,
        description="MLflow run id of a crashed, killed or failed run of this pipeline: continue "
        "it, in the same MLflow run, with its own config. The framework cannot continue from a "
        "checkpoint of ours: it trains again from the start.",
    )
    parent_run_id: SafeName | None = Field(
        default=None, description=PipelineConfig.model_fields["parent_run_id"].description
    )
    gpu_pool: str | None = Field(
        default=None, description=PipelineConfig.model_fields["gpu_pool"].description
    )

    @field_validator("framework_config")
    @classmethod
    def _config_file(cls, value: str) -> str:
        return str(find_framework_config(value))

    def for_framework(self, framework: Framework) -> "FrameworkConfig":
        """This config, trained by `framework` (the flow's own).

        Raises:
            ValueError: it names another framework.
        """
        if self.framework not in (None, framework.name):
            raise ValueError(
                f"framework: {self.framework!r} given to the {framework.name} pipeline; run "
                f"python -m {FRAMEWORKS[self.framework].flow_module} instead"
            )
        return self.model_copy(update={"framework": framework.name})

    @property
    def technique(self) -> Framework:
        """What trains the model, where the other pipelines have a technique: the framework."""
        if self.framework is None:
            raise ValueError("no framework yet: call FrameworkConfig.for_framework(framework)")
        return FRAMEWORKS[self.framework]

    def gate(self) -> list[Threshold]:
        """The champion alias goes only to a model that passes `evaluation`'s thresholds."""
        return self.evaluation.thresholds()

    def training_fields(self) -> dict[str, Any]:
        """The options that decide what is trained: a resumed run must have these equal to
        the run it continues. Placement, recovery, nesting and the environment may change."""
        keep = set(type(self).model_fields) - set(Resources.model_fields)
        keep -= {"resume", "parent_run_id", "gpu_pool", "python"}
        return self.model_dump(include=keep)

    def launch_options(self, stop_file: str | None = None) -> LaunchOptions:
        """The launcher's options (`Resources.launch_options`), the ranks on the framework
        environment's interpreter once the framework is known."""
        options = super().launch_options(stop_file)
        if self.framework is None:
            return options
        return dataclasses.replace(options, python=str(self.interpreter(self.technique)))

    def resolved(self, framework: Framework) -> "FrameworkConfig":
        """With `model` and `max_length` taken from the framework's config file when not given.

        Raises:
            ValueError: neither sets one (naming the file and its key).
        """
        if self.model is not None and self.max_length is not None:
            return self
        settings = read_framework_config(self.framework_config)
        model = self.model or _setting(settings, framework.model_key, str)
        length = self.max_length or _setting(settings, framework.length_key, int)
        for value, key, option in (
            (model, framework.model_key, "--model"),
            (length, framework.length_key, "--max-length"),
        ):
            if value is None:
                raise ValueError(
                    f"{self.framework_config}: sets nothing at {'.'.join(key)}; set it there "
                    f"or give {option}"
                )
        return self.model_copy(update={"model": model, "max_length": length})

    @property
    def base_model(self) -> str:
        """The base model of a resolved config (`resolved`)."""
        if self.model is None:
            raise ValueError("no base model yet: call FrameworkConfig.resolved(framework)")
        return self.model

    def sft_view(self) -> SFTConfig:
        """The same model, tokenizer and data as an SFT config: the data task and evaluation
        prepare and score exactly what the SFT pipeline would."""
        return SFTConfig.model_validate(
            {
                "model": self.model,
                "tokenizer": self.tokenizer,
                "dataset": self.dataset,
                "max_length": self.max_length,
                "validation_fraction": self.validation_fraction,
                "evaluation": self.evaluation.model_dump(),
                "gpus": self.gpus,
                "gpu_type": self.gpu_type,
            }
        )

    def data_config(self, framework: Framework | None = None) -> DataConfig:
        """The data task's config; for a framework that reads MDS, with the chat `turns`
        column its loader reads (LLM Foundry's finetuning layout)."""
        data = self.sft_view().data_config()
        if framework is None or framework.data_format != "mds":
            return data
        turns = data.transform.model_copy(update={"turns": True})
        return data.model_copy(update={"transform": turns})

    def tokenizer_path(self) -> str:
        return self.sft_view().tokenizer_path()

    def interpreter(self, framework: Framework) -> Path:
        return Path(self.python).expanduser() if self.python else framework.default_python()


def _setting(settings: dict[str, Any], key: tuple[str, ...], kind: type) -> Any:
    """The value at `key` in a framework's config, if it is of `kind` (else None)."""
    value: Any = settings
    for part in key:
        value = value.get(part) if isinstance(value, dict) else None
    return value if isinstance(value, kind) and not isinstance(value, bool) and value else None


def shipped_configs() -> list[str]:
    """The framework configs shipped in trainflow/presets/frameworks, by name."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def find_framework_config(value: str) -> Path:
    """A framework config file: a path (from the working directory, else from the repository,
    as a deployment's worker may start elsewhere), or the name of a shipped one
    (`axolotl-olmo3-7b`)."""
    path = Path(value).expanduser()
    for candidate in (path, REPO_ROOT / path, PRESETS_DIR / f"{value}.yaml"):
        if candidate.is_file():
            return candidate.resolve()
    raise ValueError(
        f"{value}: no such file (the framework's own YAML config, or one of the shipped: "
        f"{', '.join(shipped_configs())})"
    )


def read_framework_config(path: str | Path) -> dict[str, Any]:
    """The framework's config file as a mapping, or a ValueError naming the file."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping, got {type(data).__name__}")
    return data


class FrameworkSetupError(ValueError):
    """A framework run cannot start as set up: its config file, its environment, its device."""
