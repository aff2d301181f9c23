"""Pipelines started together on a fresh MLflow store all complete (issue: the store's schema
migration and the experiment's creation raced, and all but one run died)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


def _three_together(args: list[str], env: dict[str, str]) -> list[str]:
    """Start three `python -m flows.mlp ARGS` at once; assert all succeed; return their output."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "flows.mlp", *args],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-3000:]
    return outputs


def test_three_pipelines_on_a_fresh_store_and_a_fresh_prefect_home_all_register(tmp_path):
    """No PREFECT_API_URL: each run starts a temporary server on the same new Prefect database,
    which each server migrates as it starts; they take turns. The MLflow store is new too: its
    schema migration and the experiment's creation race. All three complete and register."""
    store = tmp_path / "fresh" / "mlflow.db"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{store}",
    }
    args = ["--max-steps", "5", "--min-r2", "-100", "--registered-model-name", "mlp-homes"]
    for out in _three_together(args, env):
        assert "OperationalError" not in out, out[-3000:]
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    versions = client.search_model_versions("name='mlp-homes'")
    assert sorted(int(v.version) for v in versions) == [1, 2, 3]
    assert len({v.run_id for v in versions}) == 3
    runs = client.search_runs([client.get_experiment_by_name("mlp").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * 3


def test_three_preparations_of_one_dataset_on_a_fresh_trainflow_home_publish_it_once(
    prefect_api, tmp_path
):
    """Three `python -m flows.prepare` at once on a new TRAINFLOW_HOME: each builds the dataset
    in its own staging folder, one publishes it, and all three return that one dataset."""
    home = tmp_path / "fresh-home"
    env = {**os.environ, "TRAINFLOW_HOME": str(home)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "flows.prepare", "--preset", "instructions"],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out[out.index("{") :]))
    assert len({r["uri"] for r in results}) == 1
    published = Path(results[0]["uri"])
    assert [p.name for p in published.parent.iterdir()] == [published.name]  # no staging left
    assert {int(r["splits"]["train"]["num_samples"]) for r in results} == {
        int(results[0]["splits"]["train"]["num_samples"])
    }
