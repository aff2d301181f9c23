"""What every pipeline config has beside its own options: placement, checkpoints and resume.

Pipeline configs subclass `PipelineConfig`, so `--gpus`, `--checkpoint-every` or `--resume` mean
the same in every pipeline, on the command line, in the Prefect UI and in deployments.
"""

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, Field, field_validator, model_validator

from trainflow.data.paths import is_remote
from trainflow.paths import SafeName
from trainflow.resources import Resources
from trainflow.storage import check_output_root, read_run_config


class PipelineConfig(Resources):
    """Where the ranks run (`Resources`), how often training checkpoints, and what it resumes."""

    checkpoint_every: int = Field(
        default=100,
        ge=0,
        description="Checkpoint every N optimizer steps, at the end and on a stop (Ctrl-C, "
        "SIGTERM, cancel); 0: never, and a crash restarts from step 0.",
    )
    keep_checkpoints: int = Field(
        default=2, ge=1, description="Complete checkpoints kept; older ones are deleted."
    )
    async_checkpoints: bool = Field(
        default=False,
        description="Write checkpoints in the background (DDP and FSDP in trainflow's own loop: "
        "MLP, transformer, detection; DDP in the SFT Trainer): the state is copied to host "
        "memory and training goes on while a thread writes it; it counts only once every rank's "
        "files are written. The last checkpoint and a stop's are written at once; other "
        "techniques always are.",
    )
    resume: SafeName | None = Field(
        default=None,
        description="MLflow run id of a crashed, killed or failed run of this pipeline: continue "
        "its training from its last checkpoint, in the same MLflow run, with its own config.",
    )
    output_root: str | None = Field(
        # A team's machines and pods share one location through their environment.
        default_factory=lambda: os.environ.get("TRAINFLOW_OUTPUT_ROOT") or None,
        validate_default=True,
        description="Where the run's folder (config, checkpoints) is kept: a local folder "
        "instead of $TRAINFLOW_HOME/outputs, or an object storage URI (s3://bucket/prefix, "
        "gs://, az://) each complete checkpoint is uploaded to, from which `--resume` continues "
        "on any machine (give it again with --resume). None: $TRAINFLOW_OUTPUT_ROOT, else "
        "$TRAINFLOW_HOME/outputs.",
    )

    parent_run_id: SafeName | None = Field(
        default=None,
        description="MLflow run this run is nested under (a sweep's run, which sets it for each "
        "trial). The run is tagged as its child, and registration never moves the workload's "
        "alias: the parent gives it to its best trial.",
    )
    gpu_pool: str | None = Field(
        default=None,
        description="Prefect global concurrency limit counted in ranks (GPUs, or CPU processes): "
        "training holds `gpus` of its slots while its ranks run, so sweeps and runs sharing the "
        "pool never start more ranks than it has. The limit must exist; none: no limit.",
    )

    @field_validator("output_root")
    @classmethod
    def _reachable_output_root(cls, root: str | None) -> str | None:
        if root is None:
            return None
        check_output_root(root)
        if is_remote(root):
            return root.rstrip("/")
        return str(Path(root).expanduser().absolute())  # the ranks may start elsewhere

    # Whether the pipeline's checkpoints can be written in the background (`async_checkpoints`),
    # and under which techniques: trainflow's own loop writes DDP and FSDP ones with DCP.
    BACKGROUND_CHECKPOINTS: ClassVar[bool] = False
    BACKGROUND_TECHNIQUES: ClassVar[tuple[str, ...]] = ("ddp", "fsdp")

    @model_validator(mode="after")
    def _async_checkpoints_where_they_run(self) -> "PipelineConfig":
        if not self.async_checkpoints:
            return self
        technique = getattr(getattr(self, "technique", None), "name", None)
        if not self.BACKGROUND_CHECKPOINTS:
            raise ValueError(
                "async_checkpoints: this pipeline checkpoints through its framework's own "
                "trainer, which writes at once; leave it off"
            )
        if technique not in self.BACKGROUND_TECHNIQUES:
            raise ValueError(
                f"async_checkpoints: technique {technique!r} writes its checkpoints at once; "
                f"background checkpoints are for {' and '.join(self.BACKGROUND_TECHNIQUES)}"
            )
        return self

    def training_fields(self) -> dict[str, Any]:
        """The options that decide what is trained, not where or how robustly.

        A resumed run must have these equal to the run it continues; placement, recovery and
        checkpoint cadence may change (a run moved to another machine after a preemption).
        """
        keep = set(type(self).model_fields) - set(PipelineConfig.model_fields)
        return self.model_dump(include=keep)


def check_resume_config(pipeline: str, config: BaseModel, run_id: str) -> None:
    """Refuse to continue run `run_id` of `pipeline` with a config that trains something else.

    `config` and the run's own (saved in its output folder, or in object storage under the
    config's `output_root`) must have equal `training_fields()`:
    placement, recovery and checkpoint options may differ (a run moved to another machine),
    the model, data and training options may not.

    Raises:
        ValueError: no such run of `pipeline` here, or naming each option that differs.
    """
    saved = read_run_config(pipeline, run_id, getattr(config, "output_root", None))
    own = type(config).model_validate(saved)
    mine = _leaves(config.training_fields())  # type: ignore[attr-defined]
    theirs = _leaves(own.training_fields())  # type: ignore[attr-defined]
    changed = [
        f"{k} ({theirs.get(k)!r} -> {mine.get(k)!r})"
        for k in sorted(mine.keys() | theirs.keys())
        if mine.get(k) != theirs.get(k)
    ]
    if changed:
        raise ValueError(
            f"resume {run_id}: these options differ from the run's own config: "
            f"{', '.join(changed)}; a resumed run trains with its own config "
            f"(the command line starts from it)"
        )


def _leaves(fields: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"training": {"batch_size": 8}}` -> `{"training.batch_size": 8}`: the options a person
    typed, so a refusal names just the ones that differ."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, Mapping):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
