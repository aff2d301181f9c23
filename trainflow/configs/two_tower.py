"""Config of the two-tower recommender pipeline (Lightning, DDP by default), and its presets.

Presets are YAML files under `trainflow/presets/two_tower/` loaded into the same model:
`debug_cpu` (the default: 2 CPU ranks, minutes) and `gpu`.
"""

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainflow.configs.base import PipelineConfig
from trainflow.data.config import (
    FORMATS_BY_SUFFIX,
    DataConfig,
    PreparedDataset,
    TabularTransform,
    ValidationSplit,
    load_preset,
    name_for_file,
)
from trainflow.data.config import PRESETS_DIR as DATA_PRESETS_DIR
from trainflow.gate import Threshold
from trainflow.paths import SafeName
from trainflow.strategies.config import (
    DDPConfig,
    OptimizerConfig,
    TechniqueConfig,
    check_framework,
)

PRESETS_DIR = Path(__file__).resolve().parents[1] / "presets" / "two_tower"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class InteractionData(_Model):
    """Which interactions to read, which columns mean what, and how they split by time."""

    dataset: str = Field(
        default="interactions",
        description="A data preset (e.g. interactions) or a local CSV/JSONL/Parquet file of "
        "interactions, one row per (user, item) with a 0/1 label.",
    )
    user_column: str = Field(default="user_id", description="Integer user id column (0-based).")
    item_column: str = Field(default="item_id", description="Integer item id column (0-based).")
    category_column: str = Field(
        default="item_category", description="Integer item category column (0-based)."
    )
    label_column: str = Field(default="clicked", description="0/1 label column (1: clicked).")
    time_column: str = Field(
        default="id",
        description="Column giving the order the interactions happened in (a timestamp or "
        "sequence number): validation and test are the latest rows by it, so no model is "
        "trained on interactions that happened after the ones it is judged on.",
    )
    validation_fraction: float = Field(
        default=0.1,
        gt=0,
        lt=1,
        description="Share of the rows left after the test split that validation takes "
        "(the latest ones).",
    )
    test_fraction: float = Field(
        default=0.1, gt=0, lt=1, description="Share of all rows the test split takes (the latest)."
    )

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, dataset: str) -> str:
        """A check of the field itself, so a refusal names the option (`--data-dataset`)."""
        known = sorted(p.stem for p in DATA_PRESETS_DIR.glob("*.yaml"))
        if dataset not in known:
            path = Path(dataset).expanduser()
            if path.suffix.lower() not in FORMATS_BY_SUFFIX:
                raise ValueError(
                    f"{dataset!r} is neither a data preset {known} nor a "
                    f"file ending in {sorted(FORMATS_BY_SUFFIX)}"
                )
            if not path.is_file():
                raise ValueError(f"file {dataset!r} does not exist")
        return dataset

    def columns(self) -> dict[str, str]:
        """Config field -> source column, for the columns the towers read."""
        return {
            "user_column": self.user_column,
            "item_column": self.item_column,
            "category_column": self.category_column,
            "label_column": self.label_column,
        }


class TowerSettings(_Model):
    """The two towers: id (and category) embeddings through MLPs, scored by a dot product."""

    num_users: int = Field(default=200, ge=1, description="Users: user ids are 0..num_users-1.")
    num_items: int = Field(default=100, ge=1, description="Items: item ids are 0..num_items-1.")
    num_categories: int = Field(
        default=4, ge=1, description="Item categories: ids are 0..num_categories-1."
    )
    embedding_dim: int = Field(default=16, ge=1, description="Width of the id embeddings.")
    hidden_sizes: list[int] = Field(
        default_factory=lambda: [32],
        description="Hidden layer widths of each tower's MLP (empty: one linear layer).",
    )
    output_dim: int = Field(
        default=16, ge=1, description="Width of the user and item vectors the dot product joins."
    )

    @model_validator(mode="after")
    def _positive_widths(self) -> "TowerSettings":
        for i, width in enumerate(self.hidden_sizes):
            if width < 1:
                raise ValueError(f"hidden_sizes[{i}]={width}: layer widths must be at least 1")
        return self


class TrainingSettings(_Model):
    """Batches, negatives, optimizer, cadence."""

    batch_size: int = Field(default=128, ge=1, description="Interactions per rank per step.")
    num_negatives: int = Field(
        default=1,
        ge=0,
        description="Random items drawn per clicked interaction as extra negatives (label 0).",
    )
    num_epochs: int = Field(default=10, ge=1, description="Passes over the training split.")
    max_steps: int | None = Field(
        default=None, ge=1, description="Stop after this many steps (sooner than num_epochs)."
    )
    optimizer: OptimizerConfig = Field(
        default_factory=lambda: OptimizerConfig(learning_rate=0.01, weight_decay=0.1),
        description="AdamW settings.",
    )
    log_every: int = Field(default=10, ge=1, description="Log the training loss every N steps.")
    seed: int = Field(default=0, description="Seed of the initial weights, negatives, data order.")
    log_samples: bool = Field(
        default=False,
        description="Record the row ids each rank trained on, per step (samples/rank_N.jsonl "
        "in the run's output folder), an audit trail of the data partition.",
    )


class EvaluationSettings(_Model):
    """Test-split metrics of the trained and the untrained model, and the gate."""

    top_k: int = Field(default=10, ge=1, description="k of recall@k (items ranked per user).")
    min_auroc: float = Field(
        default=0.7,
        ge=0,
        le=1,
        description="Gate: the champion alias goes only to a model whose test AUROC reaches this.",
    )


class TwoTowerConfig(PipelineConfig):
    """Everything the two-tower pipeline needs; shown as the run form in the Prefect UI."""

    data: InteractionData = Field(
        default_factory=InteractionData, description="Interactions, their columns and splits."
    )
    towers: TowerSettings = Field(default_factory=TowerSettings, description="The two towers.")
    training: TrainingSettings = Field(
        default_factory=TrainingSettings, description="Batches, negatives, optimizer, cadence."
    )
    evaluation: EvaluationSettings = Field(
        default_factory=EvaluationSettings, description="Test metrics and the gate."
    )
    technique: TechniqueConfig = Field(
        default_factory=DDPConfig,
        description="Technique the Lightning Trainer applies: ddp or fsdp (deepspeed on GPUs).",
    )
    experiment_name: SafeName = Field(default="two_tower", description="MLflow experiment.")
    registered_model_name: SafeName = Field(
        default="two_tower", description="MLflow registered model to add a version to."
    )

    @model_validator(mode="after")
    def _check(self) -> "TwoTowerConfig":
        self.technique.check_world_size(self.gpus)
        check_framework(self.technique, "lightning")
        names = self.data.columns() | {"time_column": self.data.time_column}
        if len(set(names.values())) != len(names):
            raise ValueError(f"data: each column must have one role, got {names}")
        return self

    def gate(self) -> list[Threshold]:
        """The champion alias goes only to a model whose test AUROC reaches `min_auroc`."""
        return [Threshold("eval_auroc", ">=", self.evaluation.min_auroc, "evaluation.min_auroc")]

    def data_config(self) -> DataConfig:
        """The dataset to prepare: typed columns, then test and validation split off by time."""
        d = self.data
        columns = {
            d.user_column: "int64",
            d.item_column: "int64",
            d.category_column: "int64",
            d.label_column: "float32",
        }
        splits = {
            "test": ValidationSplit(
                fraction=d.test_fraction, name="test", order_column=d.time_column
            ),
            "validation": ValidationSplit(
                fraction=d.validation_fraction, name="validation", order_column=d.time_column
            ),
        }
        if (DATA_PRESETS_DIR / f"{d.dataset}.yaml").is_file():
            base = load_preset(d.dataset)
            source, name, id_column = base.source, base.name, base.id_column
        else:
            path = Path(d.dataset).expanduser().resolve()
            source = {"kind": "files", "files": {"train": [str(path)]}}  # type: ignore[assignment]
            name, id_column = name_for_file(path), None
        return DataConfig.model_validate(
            {
                "name": name,
                "source": source,
                "splits": ["train"],
                "id_column": id_column,
                "transform": TabularTransform(columns=columns),
                "shard_size": "1mb",
                **splits,
            }
        )


def two_tower_preset_names() -> list[str]:
    """Names of the shipped presets under `trainflow/presets/two_tower/`."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_two_tower_preset(name: str) -> TwoTowerConfig:
    """A shipped preset (YAML under `trainflow/presets/two_tower/`), e.g. 'debug_cpu'."""
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(
            f"unknown two_tower preset {name!r}; known presets: {two_tower_preset_names()}"
        )
    return TwoTowerConfig.model_validate(yaml.safe_load(path.read_text()))


class TwoTowerJob(_Model):
    """What each rank needs: the config and the prepared dataset to read."""

    config: TwoTowerConfig = Field(description="The pipeline's config.")
    data: PreparedDataset = Field(description="Prepared MDS dataset (train, validation, test).")
    item_categories: list[int] = Field(
        description="Category of every item id (the item tower's input for sampled negatives)."
    )
