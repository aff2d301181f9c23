"""What this machine cannot run is refused before the MLflow run or any rank exists.

This machine has no GPU, so asking for one is the real case here (no mock needed).
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from flows.mlp import mlp
from tests.conftest import REPO_ROOT
from trainflow import tracking
from trainflow.configs.mlp import MLPConfig
from trainflow.launch.plan import GpuInventory, ResourceError
from trainflow.paths import trainflow_home

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
    # Refused before a Prefect server, an MLflow store or a rank started: nothing was written
    # (not even a SQLite store). The bound only catches a start-up that waited on something;
    # the time itself is the CLI's start (benchmarks/cli_startup.py), slower on a busy machine.
    assert list(tmp_path.iterdir()) == []
    assert elapsed < 45, elapsed


def test_flow_refuses_before_the_mlflow_run_exists(prefect_api):
    with pytest.raises(ResourceError, match="gpu_type='A100'"):
        mlp(MLPConfig(gpu_type="A100", registered_model_name="mlp-preflight"))
    client = tracking.store_client()
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


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"training": {"lr_scheduler": "nosuch"}}, "training.lr_scheduler='nosuch' is not a"),
        (
            {"lora": True, "lora_settings": {"target_modules": ["q_proj", "nosuch_proj"]}},
            "lora_settings.target_modules: 'nosuch_proj' names no module of tiny-llama",
        ),
    ],
    ids=["scheduler", "lora-target"],
)
def test_sft_names_the_ranks_would_fail_on_are_refused_before_data_or_runs(
    prefect_api, update, message
):
    from flows.sft import sft
    from trainflow.configs.sft import SFTConfig, load_sft_preset

    config = SFTConfig.model_validate(load_sft_preset("debug_cpu").model_dump() | update)
    with pytest.raises(ValueError, match=re.escape(message)):
        sft(config)
    client = tracking.store_client()
    experiment = client.get_experiment_by_name("sft")
    assert experiment is None or client.search_runs([experiment.experiment_id]) == []
    assert not (trainflow_home() / "runs").exists()  # no rank started
    assert not (trainflow_home() / "datasets").exists()  # nothing was prepared


def test_sft_command_line_refuses_an_unknown_scheduler_as_a_usage_error(tmp_path):
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "flows.sft", "--training-lr-scheduler", "nosuch"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "MLFLOW_TRACKING_URI": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: training.lr_scheduler='nosuch' is not a schedule" in proc.stderr
    assert "Traceback" not in proc.stderr
    # The name check runs while the temporary server starts: it is stopped again.
    if "Starting temporary server" in proc.stderr:
        assert "Stopping temporary server" in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 60, elapsed
    assert list(tmp_path.iterdir()) == []  # no MLflow store, nothing else


def test_sft_command_line_names_the_bad_line_of_a_chat_file(tmp_path):
    data = tmp_path / "chats.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    row = json.dumps({"messages": turns})
    data.write_text(f"{row}\n{row}\n{row[:30]}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "flows.sft", "--dataset", str(data)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "MLFLOW_TRACKING_URI": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"file {data} of split 'train': line 3, column" in proc.stderr
    assert "Traceback" not in proc.stderr and "temporary server" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]
