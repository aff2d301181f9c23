"""What every pipeline config has beside its own options: placement, checkpoints and resume.

Pipeline configs subclass `PipelineConfig`, so `--gpus`, `--checkpoint-every` or `--resume` mean
the same in every pipeline, on the command line, in the Prefect UI and in deployments.
"""

from typing import Any

from pydantic import Field

from trainflow.paths import SafeName
from trainflow.resources import Resources


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
    resume: SafeName | None = Field(
        default=None,
        description="MLflow run id of a crashed, killed or failed run of this pipeline: continue "
        "its training from its last checkpoint, in the same MLflow run, with its own config.",
    )

    def training_fields(self) -> dict[str, Any]:
        """The options that decide what is trained, not where or how robustly.

        A resumed run must have these equal to the run it continues; placement, recovery and
        checkpoint cadence may change (a run moved to another machine after a preemption).
        """
        keep = set(type(self).model_fields) - set(PipelineConfig.model_fields)
        return self.model_dump(include=keep)
