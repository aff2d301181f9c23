"""Where trainflow keeps its files: one root, overridable with TRAINFLOW_HOME."""

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import StringConstraints

SAFE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_SAFE_NAME = re.compile(SAFE_NAME_PATTERN)

# A run, dataset, experiment or model name: one path component that cannot escape its folder
# ("/" and a leading "." are refused). As a pydantic type it is also in the JSON schema, so the
# Prefect server rejects a bad name before a run is created.
SafeName = Annotated[str, StringConstraints(pattern=SAFE_NAME_PATTERN)]


def trainflow_home() -> Path:
    """Root for runs, datasets and caches: `$TRAINFLOW_HOME`, else ~/.cache/trainflow."""
    return Path(os.environ.get("TRAINFLOW_HOME") or Path.home() / ".cache" / "trainflow")


def safe_name(value: str, what: str = "name") -> str:
    """Return `value` if it is usable as one path component, else raise naming `what`.

    Rejects separators, `..`, leading dots and anything outside `[A-Za-z0-9._-]`, so a run,
    dataset or model name can never escape the folder it is written under.
    """
    if not _SAFE_NAME.match(value):
        raise ValueError(
            f"{what} {value!r} is not a safe name: use letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, at most 128 characters"
        )
    return value


RUN_CONFIG_FILE = "config.json"
# In a run's output folder: its appearance stops the training (checkpoint first), not retried.
STOP_FILE = "STOP"


def run_output_dir(pipeline: str, run_id: str, root: str | Path | None = None) -> Path:
    """A pipeline run's own folder: its config, checkpoints, progress and trained model.

    Keyed by the MLflow run id, so `--resume RUN_ID` finds the checkpoints of the run it
    continues. Kept under `root/<pipeline>/` (a run's `output_root` folder), by default under
    TRAINFLOW_HOME/outputs.
    """
    base = Path(root) if root is not None else trainflow_home() / "outputs"
    return base / safe_name(pipeline, "pipeline") / safe_name(run_id, "run id")


def read_run_config(pipeline: str, run_id: str, root: str | Path | None = None) -> dict[str, Any]:
    """The config a pipeline run was started with (saved in its output folder, under `root`
    as in `run_output_dir`).

    Raises:
        ValueError: no run `run_id` of `pipeline` was started under `root` (by default, this
            TRAINFLOW_HOME).
    """
    path = run_output_dir(pipeline, run_id, root) / RUN_CONFIG_FILE
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        where = "this TRAINFLOW_HOME" if root is None else str(root)
        raise ValueError(
            f"no {pipeline} run {run_id} was started under {where} ({path} is missing)"
        ) from None
    return data
