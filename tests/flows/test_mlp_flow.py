"""`python -m flows.mlp` end to end: real Prefect server, 2 gloo ranks, temporary MLflow store."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from tests.conftest import REPO_ROOT
from trainflow import tracking

pytestmark = pytest.mark.slow


SECRET = "hf_trainflowTestSecret0123456789"
EFFICIENCY = ("eff_samples_per_s", "eff_step_time_s", "eff_data_wait_share", "eff_peak_memory_mb")


def flow_run_artifacts(flow_run_id: str) -> dict[str, object]:
    """The Prefect artifacts of a flow run, by key."""
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return {a.key: a for a in found}


def check_efficiency_figures(metrics: dict[str, float], summary: str, tokens: bool) -> None:
    """The run's efficiency figures are there and plausible for 2 CPU ranks: in its metrics, in
    its summary artifact, with tokens/s only for a model of tokens and no GPU figures; and
    MLflow's own system metrics were sampled."""
    names = [*EFFICIENCY, *(["eff_tokens_per_s"] if tokens else [])]
    for name in names:
        assert name in summary, name
    assert ("eff_tokens_per_s" in metrics) == tokens
    assert metrics["eff_samples_per_s"] > 0 and metrics["eff_step_time_s"] > 0
    assert 0.0 <= metrics["eff_data_wait_share"] <= 1.0
    assert 10 < metrics["eff_peak_memory_mb"] < 64_000  # the resident set of a torch process
    if tokens:
        assert metrics["eff_tokens_per_s"] > metrics["eff_samples_per_s"]
    assert "eff_mfu" not in metrics and "eff_gpu_hours" not in metrics  # no GPU here


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "flows.mlp", *args],
        cwd=REPO_ROOT,
        env={**os.environ, "HF_TOKEN": SECRET},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def test_mlp_pipeline_registers_a_model_that_learned(prefect_api, tmp_path):
    proc = _run("--num-epochs", "3", "--registered-model-name", "mlp-e2e")
    out = proc.stdout + proc.stderr
    assert re.search(r"Model +: mlp-e2e version 1", out)
    assert "[rank 1]" not in out or "Task run" in out  # rank lines are routed through Prefect
    client = tracking.store_client()
    version = client.get_model_version("mlp-e2e", "1")
    run = client.get_run(version.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["eval_r2"] > 0.5
    assert run.data.params["gpus"] == "2"
    assert version.tags["technique"] == "ddp" and version.tags["world_size"] == "2"
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert len(history) >= 2 and history[-1].value < history[0].value
    summary = flow_run_artifacts(run.data.tags["prefect_flow_run_id"])["mlp-summary"].data
    check_efficiency_figures(run.data.metrics, summary, tokens=False)
    assert run.data.metrics["system/cpu_utilization_percentage"] >= 0
    assert run.data.metrics["system/system_memory_usage_megabytes"] > 0
    import mlflow.pytorch

    model = mlflow.pytorch.load_model("models:/mlp-e2e/1")
    assert isinstance(model, torch.nn.Module)
    assert model(torch.zeros(3, 10)).shape == (3, 1)
    _assert_secret_nowhere(out, client, run, version)


def _assert_secret_nowhere(output, client, run, version) -> None:
    """A token in the environment reaches no param, tag, log line, artifact or run file."""
    assert SECRET not in output
    texts = [*run.data.params.values(), *run.data.tags.values(), *version.tags.values()]
    assert not any(SECRET in t for t in texts)
    db = Path(os.environ["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///"))
    roots = [db.parent / "mlartifacts", Path(os.environ["TRAINFLOW_HOME"])]
    files = [p for root in roots for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "rank_1.log" for p in files) and any(p.name == "MLmodel" for p in files)
    assert not [p for p in files if SECRET.encode() in p.read_bytes()]
    assert SECRET.encode() not in db.read_bytes()


def test_mlp_pipeline_that_does_not_learn_registers_nothing(prefect_api):
    proc = _run(
        "--max-steps", "1", "--learning-rate", "1e-9", "--registered-model-name", "mlp-gate"
    )
    assert "not registered" in proc.stdout
    client = tracking.store_client()
    assert client.search_model_versions("name='mlp-gate'") == []


def test_mlp_pipeline_failing_in_training_marks_the_run_failed(prefect_api):
    # Ranks cannot even start in 2 s: the launch times out, the flow fails.
    proc = _run("--timeout-s", "2", "--registered-model-name", "mlp-fail", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "timed out after 2s" in out
    client = tracking.store_client()
    experiment = client.get_experiment_by_name("mlp")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
    assert client.search_model_versions("name='mlp-fail'") == []
