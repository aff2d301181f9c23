"""A framework launch killed mid-run is relaunched (`--retries`), from scratch; a framework's own
error is not. Real 2-rank launches in this environment, through the framework training task."""

import os
import signal
from pathlib import Path

import pytest
import torch.distributed as dist
from prefect import flow

from flows.frameworks import _train_with_framework
from tasks.techniques import retry_if_transient
from trainflow import RankError, runtime
from trainflow.launch.spec import LaunchOptions

pytestmark = pytest.mark.slow


def killed_once(marker: str, overrides: dict) -> dict:
    """Rank 1 of the first attempt dies as the OOM killer would; the next attempt trains."""
    model_dir = Path(overrides["output_dir"])
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / f"half-saved-{runtime.get_global_rank()}").touch()
    first = not Path(marker).exists()
    dist.barrier()  # both ranks saw the marker before rank 1 makes it
    if first and runtime.get_global_rank() == 1:
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return {"attempt_files": sorted(p.name for p in model_dir.iterdir())}


def bad_config(marker: str, overrides: dict) -> dict:
    with open(marker, "a") as calls:
        calls.write(f"rank {runtime.get_global_rank()}\n")
    raise ValueError("learning_rate: must be positive")


@flow
def train_once(fn, marker: str, model_dir: Path, retries: int) -> dict:
    options = LaunchOptions(gpus=2, gpu_type="cpu", timeout=120, init_process_group=True)
    attempt = _train_with_framework.with_options(
        retries=retries, retry_condition_fn=retry_if_transient
    )
    return attempt(fn, marker, {"output_dir": str(model_dir)}, options, model_dir)


def test_a_killed_launch_is_relaunched_with_no_half_saved_model_left(prefect_api, tmp_path):
    marker, model_dir = tmp_path / "killed", tmp_path / "model"
    result = train_once(killed_once, str(marker), model_dir, retries=1)
    assert marker.exists()  # the first attempt did die
    # The second attempt found none of the first one's files.
    assert result["attempt_files"] == ["half-saved-0", "half-saved-1"]


def test_an_error_of_the_framework_itself_is_not_retried(prefect_api, tmp_path):
    marker = tmp_path / "calls"
    with pytest.raises(RankError, match="learning_rate: must be positive"):
        train_once(bad_config, str(marker), tmp_path / "model", retries=2)
    assert len(marker.read_text().splitlines()) <= 2  # one attempt: at most one call per rank
