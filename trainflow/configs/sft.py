"""Config of the supervised fine-tuning pipeline, its presets, and the quality gate.

Presets are YAML files under `trainflow/presets/sft/` loaded into the same model.
"""

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainflow.configs.base import PipelineConfig
from trainflow.data.config import PRESETS_DIR as DATA_PRESETS_DIR
from trainflow.data.config import REPO_ROOT, ChatTransform, DataConfig, PreparedDataset, load_preset
from trainflow.gate import Threshold, gate_failures
from trainflow.paths import SafeName
from trainflow.strategies.config import (
    DDPConfig,
    OptimizerConfig,
    TechniqueConfig,
    check_framework,
)

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


class SFTConfig(PipelineConfig):
    """Everything the SFT pipeline needs; shown as the run form in the Prefect UI."""

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
    technique: TechniqueConfig = Field(
        default_factory=DDPConfig,
        description="Technique: ddp, fsdp or deepspeed, or a JSON object with its options.",
    )
    experiment_name: SafeName = Field(default="sft", description="MLflow experiment.")
    registered_model_name: SafeName = Field(
        default="sft", description="MLflow registered model to add a version to."
    )

    @model_validator(mode="after")
    def _check(self) -> "SFTConfig":
        self.technique.check_world_size(self.gpus)
        check_framework(self.technique, "hf")  # SFT trains with the Hugging Face Trainer
        known = sorted(p.stem for p in DATA_PRESETS_DIR.glob("*.yaml"))
        if _looks_like_a_file(self.dataset):
            if not Path(self.dataset).expanduser().is_file():
                raise ValueError(f"dataset file {self.dataset!r} does not exist")
        elif self.dataset not in known and "/" not in self.dataset:
            raise ValueError(
                f"dataset {self.dataset!r} is neither a data preset {known}, a local file nor a "
                "Hub id (owner/name)"
            )
        return self

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
            name, source = path.stem, {"kind": "files", "files": {"train": [str(path)]}}
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


class SFTJob(_Model):
    """What each rank needs: the config and the prepared dataset to read."""

    config: SFTConfig = Field(description="The pipeline's config.")
    data: PreparedDataset = Field(description="Prepared MDS dataset (train and validation).")


def sft_gate_failures(settings: EvaluationSettings, metrics: dict[str, float]) -> list[str]:
    """Why the trained model is not a champion; empty when it passes the gate."""
    return gate_failures(settings.thresholds(), metrics)
