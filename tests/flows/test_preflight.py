"""What this machine cannot run is refused before the MLflow run or any rank exists.

This machine has no GPU, so asking for one is the real case here (no mock needed).
"""

import os
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from flows.mlp import mlp
from tests.conftest import REPO_ROOT
from trainflow.configs.mlp import MLPConfig
from trainflow.paths import trainflow_home
from trainflow.resources import GpuInventory, ResourceError

pytestmark = pytest.mark.skipif(
    GpuInventory.detect().count > 0, reason="this machine has GPUs, so asking for one is no error"
)


def _mlp(cwd, *args: str) -> subprocess.CompletedProcess:
    """`python -m flows.mlp ARGS` in `cwd`, with the default MLflow store (a file in `cwd`)."""
    return subprocess.run(
        [sys.executable, "-m", "flows.mlp", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "MLFLOW_TRACKING_URI": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_command_line_refuses_a_missing_gpu_type_at_once(tmp_path):
    started = time.monotonic()
    proc = _mlp(tmp_path, "--gpu-type", "A100")
    elapsed = time.monotonic() - started
    assert proc.returncode == 2
    assert "python -m flows.mlp: error: gpu_type='A100' requested" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert elapsed < 15, elapsed  # no Prefect server, no MLflow store, no ranks
    assert list(tmp_path.iterdir()) == []  # not even a SQLite store was created


def test_flow_refuses_before_the_mlflow_run_exists(prefect_api):
    with pytest.raises(ResourceError, match="gpu_type='A100'"):
        mlp(MLPConfig(gpu_type="A100", registered_model_name="mlp-preflight"))
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("mlp")
    assert experiment is None or client.search_runs([experiment.experiment_id]) == []
    assert not (trainflow_home() / "runs").exists()


def test_command_line_refuses_far_more_cpu_ranks_than_cores(tmp_path):
    ranks = 4 * (os.cpu_count() or 1) + 1
    proc = _mlp(
        tmp_path, "--gpu-type", "cpu", "--gpus", str(ranks), "--num-train-samples", str(64 * ranks)
    )
    assert proc.returncode == 2
    assert f"gpus={ranks} would start {ranks} CPU ranks" in proc.stderr
    assert list(tmp_path.iterdir()) == []
