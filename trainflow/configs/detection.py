"""Config of the RetinaNet object-detection pipeline, its presets and its quality gate.

Presets are YAML files under `trainflow/presets/detection/` loaded into the same model:
`debug_cpu` (the default: 64 px images, a tiny backbone, 2 CPU ranks, minutes) and `gpu`
(larger images, a ResNet-50 backbone, 8 GPUs).
"""

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainflow.configs.base import PipelineConfig
from trainflow.data.config import DataConfig, PreparedDataset
from trainflow.data.shapes import MAX_CLASSES, ShapesSpec
from trainflow.gate import Threshold
from trainflow.paths import SafeName
from trainflow.strategies.config import DDPConfig, OptimizerConfig

PRESETS_DIR = Path(__file__).resolve().parents[1] / "presets" / "detection"
# Below this the smallest objects (a fifth of the image) are a few pixels wide, and the
# stride-16 level of the pyramid is a 1 x 1 map.
MIN_IMAGE_SIZE = 32


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ShapesData(_Model):
    """The generated dataset: coloured shapes with boxes on textured backgrounds."""

    num_classes: int = Field(
        default=3,
        ge=1,
        le=MAX_CLASSES,
        description=f"Object classes (a shape in its own colour each), 1 to {MAX_CLASSES}.",
    )
    image_size: int = Field(
        default=64,
        ge=MIN_IMAGE_SIZE,
        description=f"Side of the square images in pixels (at least {MIN_IMAGE_SIZE}).",
    )
    num_train_images: int = Field(default=256, ge=1, description="Training images.")
    num_eval_images: int = Field(
        default=64, ge=1, description="Held-out images the mAP is measured on."
    )
    max_objects: int = Field(default=3, ge=1, le=8, description="Most objects in one image.")
    seed: int = Field(default=0, description="Seed of the generated images.")

    def spec(self) -> ShapesSpec:
        """The generator's spec: objects are a fifth to just under a half of the image."""
        return ShapesSpec(
            num_classes=self.num_classes,
            image_size=self.image_size,
            max_objects=self.max_objects,
            min_object_size=round(self.image_size * 0.22),
            max_object_size=round(self.image_size * 0.44),
            seed=self.seed,
        )

    def counts(self) -> dict[str, int]:
        """Images per split."""
        return {"train": self.num_train_images, "validation": self.num_eval_images}


class ModelSettings(_Model):
    """RetinaNet's backbone and sizes (always built without pretrained weights)."""

    backbone: Literal["tiny", "resnet18", "resnet50"] = Field(
        default="tiny",
        description="Feature extractor: 'tiny' (a 5-layer CNN, for CPUs), 'resnet18' or "
        "'resnet50' (torchvision's, up to layer3).",
    )
    fpn_channels: int = Field(
        default=64, ge=8, description="Width of the FPN maps and of the detection heads."
    )
    detections_per_image: int = Field(
        default=100, ge=1, description="Most boxes the model returns per image."
    )


class TrainingSettings(_Model):
    """Steps, batches, optimizer and logging cadence."""

    num_steps: int = Field(default=200, ge=1, description="Optimizer steps.")
    global_batch_size: int = Field(
        default=16, ge=1, description="Images per optimizer step over all ranks."
    )
    optimizer: OptimizerConfig = Field(
        default_factory=OptimizerConfig, description="AdamW settings."
    )
    log_every: int = Field(default=20, ge=1, description="Log the losses every N steps.")
    seed: int = Field(default=0, description="Seed of the initial weights and the data order.")


class EvaluationSettings(_Model):
    """Held-out mAP of the trained model against the untrained one, the gate and the plot."""

    batch_size: int = Field(default=32, ge=1, description="Images per forward pass.")
    min_map: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="Gate: held-out mAP (COCO, IoU 0.50:0.95) must reach this to register.",
    )
    num_plot_images: int = Field(
        default=6, ge=1, le=16, description="Held-out images shown with their predicted boxes."
    )
    plot_min_score: float = Field(
        default=0.3, ge=0, le=1, description="Boxes scoring below this are left off the plot."
    )


class DetectionConfig(PipelineConfig):
    """Everything the detection pipeline needs; shown as the run form in the Prefect UI."""

    BACKGROUND_CHECKPOINTS = True  # trains in trainflow's own loop

    data: ShapesData = Field(default_factory=ShapesData, description="The generated dataset.")
    model: ModelSettings = Field(
        default_factory=ModelSettings, description="RetinaNet backbone and sizes."
    )
    training: TrainingSettings = Field(
        default_factory=TrainingSettings, description="Steps, batches, optimizer."
    )
    evaluation: EvaluationSettings = Field(
        default_factory=EvaluationSettings, description="Held-out mAP, the gate and the plot."
    )
    technique: DDPConfig = Field(
        default_factory=DDPConfig, description="DDP options (detection trains with DDP)."
    )
    checkpoint_every: int = Field(
        default=50,
        ge=0,
        description="Checkpoint every N optimizer steps, at the end and on a stop (Ctrl-C, "
        "SIGTERM, cancel); 0: never, and a crash restarts from step 0.",
    )
    experiment_name: SafeName = Field(default="detection", description="MLflow experiment.")
    registered_model_name: SafeName = Field(
        default="detection",
        description="MLflow registered model to add a version to (letters, digits, ._-).",
    )

    @model_validator(mode="after")
    def _check(self) -> "DetectionConfig":
        self.per_rank_batch_size(self.gpus)
        if self.training.global_batch_size > self.data.num_train_images:
            raise ValueError(
                f"training.global_batch_size={self.training.global_batch_size} exceeds "
                f"data.num_train_images={self.data.num_train_images}: no full step fits"
            )
        return self

    def per_rank_batch_size(self, world_size: int) -> int:
        """Images per rank per step; raise if the global batch does not split over the ranks."""
        if self.training.global_batch_size % world_size:
            raise ValueError(
                f"training.global_batch_size={self.training.global_batch_size} must be "
                f"divisible by the {world_size} ranks (gpus)"
            )
        return self.training.global_batch_size // world_size

    @property
    def optimizer(self) -> OptimizerConfig:
        """The AdamW settings the strategy builds its optimizer from."""
        return self.training.optimizer

    def gate(self) -> list[Threshold]:
        """Registered only when the held-out mAP reaches `evaluation.min_map`."""
        return [Threshold("eval_map", ">=", self.evaluation.min_map, "evaluation.min_map")]

    def data_config(self, files: dict[str, str]) -> DataConfig:
        """The dataset to prepare from the generated Parquet files (split -> file)."""
        return DataConfig.model_validate(
            {
                "name": f"shapes-{self.data.num_classes}c-{self.data.image_size}px",
                "source": {"kind": "files", "files": {s: [p] for s, p in files.items()}},
                "transform": {"name": "detection", "num_classes": self.data.num_classes},
                # PNG bytes do not compress further, and ranks read uncompressed shards in place.
                "compression": None,
                "shard_size": "1mb",
            }
        )


def detection_preset_names() -> list[str]:
    """Names of the shipped presets under `trainflow/presets/detection/`."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_detection_preset(name: str) -> DetectionConfig:
    """A shipped preset (YAML under `trainflow/presets/detection/`), e.g. 'debug_cpu'."""
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(
            f"unknown detection preset {name!r}; known presets: {detection_preset_names()}"
        )
    return DetectionConfig.model_validate(yaml.safe_load(path.read_text()) or {})


class DetectionJob(_Model):
    """What each rank and the evaluation need: the config and the prepared dataset."""

    config: DetectionConfig = Field(description="The pipeline's config.")
    data: PreparedDataset = Field(description="Prepared MDS dataset (train and validation).")
