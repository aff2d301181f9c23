"""Config of the supervised fine-tuning pipeline, its presets, and the quality gate.

Presets are YAML files under `trainflow/presets/sft/` loaded into the same model; `tiny_twin`
turns one into the CPU run of the same recipe on the tiny model of the same family.
"""

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainflow.configs.base import PipelineConfig
from trainflow.data.config import PRESETS_DIR as DATA_PRESETS_DIR
from trainflow.data.config import (
    REPO_ROOT,
    ChatTransform,
    DataConfig,
    PreparedDataset,
    load_preset,
    name_for_file,
)
from trainflow.gate import Threshold, gate_failures
from trainflow.memory import TrainingSetup
from trainflow.paths import SafeName
from trainflow.strategies.config import (
    DDPConfig,
    DeepSpeedConfig,
    FSDPConfig,
    OptimizerConfig,
    Precision,
    Technique,
    check_framework,
)
from trainflow.strategies.technique import UNION_DESCRIPTION, technique_union

PRESETS_DIR = Path(__file__).resolve().parents[1] / "presets" / "sft"
SHIPPED_TOKENIZER = str(REPO_ROOT / "data" / "tokenizer")
# Architectures built from a config with the shipped vocabulary (`trainflow.models.causal_lm`).
TINY_MODELS = ("tiny-llama", "tiny-gpt-oss")


# What a local dataset file looks like (a Hub id is `owner/name`, a preset a bare name).
_FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def _looks_like_a_file(dataset: str) -> bool:
    return dataset.startswith(("/", "./", "../", "~")) or dataset.endswith(_FILE_SUFFIXES)


def is_tiny(name: str) -> bool:
    """True when `name` is a tiny architecture built from a config (no pretrained weights)."""
    return name in TINY_MODELS


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class LoraSettings(_Model):
    """PEFT LoRA adapter settings (used with `lora: true`); merged into the model for export."""

    r: int = Field(default=16, ge=1, description="Rank of the low-rank update.")
    alpha: int = Field(default=32, ge=1, description="Scaling numerator (scale = alpha / r).")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names that get an adapter.",
    )


class TrainingSettings(_Model):
    """Batches, optimizer and logging cadence of the Trainer."""

    per_device_batch_size: int = Field(default=16, ge=1, description="Sequences per rank per step.")
    grad_accum_steps: int = Field(default=1, ge=1, description="Micro-batches per optimizer step.")
    optimizer: OptimizerConfig = Field(
        default_factory=OptimizerConfig, description="AdamW settings."
    )
    warmup_steps: int = Field(default=0, ge=0, description="Linear learning-rate warm-up steps.")
    lr_scheduler: str = Field(default="cosine", description="Trainer learning-rate schedule.")
    logging_steps: int = Field(default=10, ge=1, description="Log training metrics every N steps.")
    seed: int = Field(default=0, description="Seed of the initial weights and the data order.")


class EvaluationSettings(_Model):
    """Held-out evaluation of the trained model against the untrained one, and the gate."""

    num_samples: int = Field(default=200, ge=1, description="Held-out conversations to score.")
    batch_size: int = Field(default=32, ge=1, description="Conversations per forward pass.")
    max_new_tokens: int = Field(default=16, ge=1, description="Longest generated answer.")
    min_exact_match: float = Field(
        default=0.0, ge=0, le=1, description="Gate: held-out exact match must reach this."
    )
    max_loss_ratio: float = Field(
        default=0.9,
        gt=0,
        description="Gate: held-out loss must be at most this share of the untrained model's.",
    )

    def thresholds(self) -> list[Threshold]:
        """The gate: exact match high enough, loss low enough relative to the untrained model."""
        return [
            Threshold("eval_exact_match", ">=", self.min_exact_match, "evaluation.min_exact_match"),
            Threshold("eval_loss_ratio", "<=", self.max_loss_ratio, "evaluation.max_loss_ratio"),
        ]


class AutoTechnique(_Model):
    """Let the memory estimate choose: DDP when a replica fits one GPU, else ZeRO-2, then FSDP
    full shard, then FSDP with CPU offload (`trainflow.memory`). Resolved when the flow starts."""

    name: Literal["auto"] = Field(default="auto", description="Technique name.")

    def describe(self) -> str:
        return "auto"


if TYPE_CHECKING:
    SFTTechnique = Annotated[
        DDPConfig | FSDPConfig | DeepSpeedConfig | AutoTechnique,
        Field(discriminator="name", description=UNION_DESCRIPTION),
    ]
else:
    SFTTechnique = technique_union(AutoTechnique)  # and any technique registered later


def _follow(technique: Technique, option: str | None, value: Any) -> Any:
    """Set the technique's `option` to the run's `value` unless the technique was given one;
    the option's value then (`value` when the technique has no such option)."""
    if option is None:
        return value
    if option not in technique.model_fields_set:
        setattr(technique, option, value)
    return getattr(technique, option)


class SFTConfig(PipelineConfig):
    """Everything the SFT pipeline needs; shown as the run form in the Prefect UI."""

    # The Trainer's DDP checkpoints are written from host copies by a thread
    # (`workloads.sft_checkpoints`); its FSDP and DeepSpeed ones by their engines, at once.
    BACKGROUND_CHECKPOINTS = True
    BACKGROUND_TECHNIQUES = ("ddp",)

    model: str = Field(
        default="tiny-llama",
        description="A tiny offline architecture (tiny-llama, tiny-gpt-oss) or a Hugging Face "
        "model id / local directory, e.g. meta-llama/Llama-3.2-1B-Instruct.",
    )
    tokenizer: str | None = Field(
        default=None,
        description="Tokenizer directory or Hub id; none: the shipped tokenizer for tiny models, "
        "else the model's own.",
    )
    dataset: str = Field(
        default="instructions",
        description="A data preset (e.g. instructions), a local JSONL/JSON/CSV/Parquet file of "
        "chats with a 'messages' column, or a Hub chat dataset, e.g. trl-lib/Capybara.",
    )
    max_length: int = Field(default=64, ge=8, description="Longest conversation in tokens.")
    validation_fraction: float = Field(
        default=0.05,
        gt=0,
        lt=1,
        description="Held-out share of a Hub dataset's train split (presets set their own).",
    )
    lora: bool = Field(default=False, description="Train a LoRA adapter instead of all weights.")
    lora_settings: LoraSettings = Field(
        default_factory=LoraSettings, description="LoRA adapter settings."
    )
    max_steps: int = Field(default=300, ge=1, description="Optimizer steps.")
    training: TrainingSettings = Field(
        default_factory=TrainingSettings, description="Batches, optimizer, logging."
    )
    evaluation: EvaluationSettings = Field(
        default_factory=EvaluationSettings, description="Held-out evaluation and the gate."
    )
    technique: SFTTechnique = Field(
        default_factory=DDPConfig,
        description="Technique: ddp, fsdp, deepspeed, or auto (chosen from the memory "
        "estimate before launch), or a JSON object with its options.",
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto",
        description="bf16: the Trainer computes in bfloat16 with fp32 master weights and "
        "optimizer state, and a LoRA run loads its frozen base in bf16 (GPU). auto: the "
        "technique's mixed_precision (fsdp, deepspeed), else fp32.",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute each layer's activations in backward (the Trainer's gradient "
        "checkpointing); under fsdp it becomes technique.activation_checkpointing.",
    )
    cpu_ram_efficient_loading: bool = Field(
        default=False,
        description="Under fsdp on GPUs: only the first rank reads the pretrained weights; "
        "the other ranks build the model on the meta device and get their shards by "
        "broadcast. Other techniques, CPU ranks and tiny models load as usual.",
    )
    gpu_memory_gb: float | None = Field(
        default=None,
        gt=0,
        description="GPU memory per GPU in GB (1e9 bytes) for the memory check and technique "
        "auto; none: detected, else the table for gpu_type.",
    )
    experiment_name: SafeName = Field(default="sft", description="MLflow experiment.")
    registered_model_name: SafeName = Field(
        default="sft", description="MLflow registered model to add a version to."
    )

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, dataset: str) -> str:
        """A check of the field itself, so a refusal names the option (`--dataset`)."""
        known = sorted(p.stem for p in DATA_PRESETS_DIR.glob("*.yaml"))
        if _looks_like_a_file(dataset):
            if not Path(dataset).expanduser().is_file():
                raise ValueError(f"dataset file {dataset!r} does not exist")
        elif dataset not in known and "/" not in dataset:
            raise ValueError(
                f"dataset {dataset!r} is neither a data preset {known}, a local file nor a "
                "Hub id (owner/name)"
            )
        return dataset

    @field_validator("technique", mode="before")
    @classmethod
    def _technique_by_name(cls, value: Any) -> Any:
        """`technique: auto` (or any technique's bare name) in a config file means its
        defaults, as `--technique NAME` does on the command line."""
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> "SFTConfig":
        technique = self.chosen_technique()
        if technique is not None:
            technique.check_world_size(self.gpus)
            check_framework(technique, "hf")  # SFT trains with the Hugging Face Trainer
            if self.precision != "auto":  # `--technique fsdp` follows it, unless given its own
                own = _follow(technique, technique.precision_option, self.precision)
                if own != self.precision:
                    raise ValueError(
                        f"precision={self.precision!r} but technique."
                        f"{technique.precision_option}={own!r}: set one of them, or both alike"
                    )
            # A technique's own recomputation replaces the Trainer's (accelerate refuses the
            # Trainer's beside FSDP's).
            option = technique.checkpointing_option
            if self.gradient_checkpointing and not _follow(technique, option, True):
                raise ValueError(
                    f"gradient_checkpointing=true but technique.{option}=false: "
                    f"under {technique.name} they are the same option; set one"
                )
        return self

    def training_fields(self) -> dict[str, Any]:
        """As `PipelineConfig`'s, less the memory per GPU (a resume may move to other GPUs)."""
        fields = super().training_fields()
        fields.pop("gpu_memory_gb", None)
        return fields

    def chosen_technique(self) -> Technique | None:
        """The technique, or None while `technique: auto` has yet to choose one."""
        return None if isinstance(self.technique, AutoTechnique) else self.technique

    def compute_precision(self) -> Precision:
        """bf16 or fp32: `precision`, else the technique's own (`mixed_precision`), else fp32."""
        if self.precision != "auto":
            return self.precision
        technique = self.chosen_technique()
        return (technique.precision if technique else None) or "fp32"

    def weights_dtype(self) -> Precision:
        """The dtype the model's weights are loaded in.

        bf16 for a LoRA run in bf16 (the frozen base), and under fsdp / deepspeed in bf16 (FSDP
        upcasts the trained shards to fp32 master weights, DeepSpeed keeps fp32 master copies
        in its optimizer); otherwise fp32, so DDP's bf16 autocast has fp32 weights to update.
        """
        technique = self.chosen_technique()
        master = technique is not None and technique.keeps_master_weights
        bf16 = self.compute_precision() == "bf16"
        return "bf16" if bf16 and (self.lora or master) else "fp32"

    def activation_checkpointing(self) -> bool:
        """Whether activations are recomputed: the Trainer's or the technique's own (FSDP's)."""
        technique = self.chosen_technique()
        own = technique is not None and technique.checkpoints_activations
        return self.gradient_checkpointing or own

    def training_setup(self) -> TrainingSetup:
        """What the memory estimate needs to know about this run (`trainflow.memory`)."""
        return TrainingSetup(
            micro_batch_size=self.training.per_device_batch_size,
            seq_len=self.max_length,
            world_size=self.gpus,
            precision=self.compute_precision(),
            weights_dtype=self.weights_dtype(),
            lora_rank=self.lora_settings.r if self.lora else None,
            lora_targets=tuple(self.lora_settings.target_modules),
            activation_checkpointing=self.activation_checkpointing(),
        )

    def with_technique(self, technique: Technique) -> "SFTConfig":
        """This config with `technique` (validated again), as `technique: auto` resolves."""
        return SFTConfig.model_validate(self.model_dump() | {"technique": technique.model_dump()})

    def tokenizer_path(self) -> str:
        """The tokenizer to use: given, the shipped one for tiny models, else the model's."""
        if self.tokenizer is not None:
            return self.tokenizer
        return SHIPPED_TOKENIZER if is_tiny(self.model) else self.model

    def gate(self) -> list[Threshold]:
        """The champion alias goes only to a model that passes `evaluation`'s thresholds."""
        return self.evaluation.thresholds()

    def data_config(self) -> DataConfig:
        """The dataset to prepare: chat turns -> tokens with an answer-only loss mask."""
        if (DATA_PRESETS_DIR / f"{self.dataset}.yaml").is_file():
            data = load_preset(self.dataset)
            if not isinstance(data.transform, ChatTransform):
                raise ValueError(f"dataset {self.dataset!r} is not chat data")
            transform = data.transform.model_copy(
                update={"tokenizer": self.tokenizer_path(), "max_length": self.max_length}
            )
            return data.model_copy(update={"transform": transform})
        if _looks_like_a_file(self.dataset):
            path = Path(self.dataset).expanduser()
            name, source = name_for_file(path), {"kind": "files", "files": {"train": [str(path)]}}
        else:
            name, source = self.dataset.replace("/", "--"), {"kind": "hub", "name": self.dataset}
        return DataConfig.model_validate(
            {
                "name": name,
                "source": source,
                "splits": ["train"],
                "validation": {"fraction": self.validation_fraction},
                "transform": {
                    "name": "chat",
                    "tokenizer": self.tokenizer_path(),
                    "max_length": self.max_length,
                },
            }
        )


def sft_preset_names() -> list[str]:
    """Names of the shipped presets under `trainflow/presets/sft/`."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_sft_preset(name: str) -> SFTConfig:
    """A shipped preset (YAML under `trainflow/presets/sft/`), e.g. 'debug_cpu'."""
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown sft preset {name!r}; known presets: {sft_preset_names()}")
    return SFTConfig.model_validate(yaml.safe_load(path.read_text()))


# The tiny architecture standing in for each model family (`tiny_twin`).
TINY_FAMILIES = {"gpt-oss": "tiny-gpt-oss", "llama": "tiny-llama"}


def tiny_family(model: str) -> str:
    """The tiny architecture of `model`'s family: tiny-gpt-oss for gpt-oss, tiny-llama for Llama.

    Raises:
        ValueError: no tiny architecture of that family.
    """
    if is_tiny(model):
        return model
    lowered = model.lower()
    for family, tiny in TINY_FAMILIES.items():
        if family in lowered:
            return tiny
    raise ValueError(f"no tiny architecture of {model!r}'s family; known: {TINY_FAMILIES}")


def tiny_twin(config: SFTConfig, max_steps: int = 8) -> SFTConfig:
    """The preset's recipe on CPU: what a 2-core machine can run end to end in seconds.

    Kept: the technique and its options (precision aside), LoRA and its settings, activation
    checkpointing, CPU-RAM-efficient loading (a no-op on CPU ranks), gradient accumulation, the
    scheduler, the gate and the registered model's name (with `-tiny`). Swapped: the model for
    the tiny architecture of its family with the shipped tokenizer, the data for the shipped
    `instructions` (64 tokens), the ranks for 2 gloo CPU ranks with fp32 (bf16 is a GPU
    setting here), the learning rate for the `debug_cpu` preset's (a tiny model starts from
    random weights), the steps for `max_steps` (one log, one checkpoint at the end), and a
    small batch and evaluation.
    """
    raw = config.model_dump()
    technique = dict(raw["technique"])
    if "mixed_precision" in technique:
        technique["mixed_precision"] = "fp32"
    debug = load_sft_preset("debug_cpu")
    training = raw["training"] | {
        "per_device_batch_size": 8,
        "warmup_steps": 0,
        "logging_steps": max_steps,
        "optimizer": raw["training"]["optimizer"]
        | {"learning_rate": debug.training.optimizer.learning_rate},
    }
    evaluation = raw["evaluation"] | {"num_samples": 16, "batch_size": 16, "max_new_tokens": 4}
    return SFTConfig.model_validate(
        raw
        | {
            "model": tiny_family(config.model),
            "tokenizer": None,
            "dataset": "instructions",
            "max_length": 64,
            "max_steps": max_steps,
            "checkpoint_every": max_steps,
            "training": training,
            "evaluation": evaluation,
            "technique": technique,
            "precision": "auto" if raw["precision"] == "auto" else "fp32",
            "gpu_memory_gb": None,
            "gpus": 2,
            "gpu_type": "cpu",
            "nnodes": 1,
            "registered_model_name": f"{config.registered_model_name}-tiny",
        }
    )


class SFTJob(_Model):
    """What each rank needs: the config and the prepared dataset to read."""

    config: SFTConfig = Field(description="The pipeline's config.")
    data: PreparedDataset = Field(description="Prepared MDS dataset (train and validation).")
    evaluate_on_ranks: bool = Field(
        default=False,
        description="After training, rank 0 evaluates the trained model (on its device) and "
        "logs it to the MLflow run; the pipeline then registers it without loading it.",
    )


def sft_gate_failures(settings: EvaluationSettings, metrics: dict[str, float]) -> list[str]:
    """Why the trained model is not a champion; empty when it passes the gate."""
    return gate_failures(settings.thresholds(), metrics)
