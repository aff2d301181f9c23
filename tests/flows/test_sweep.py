"""`flows.sweep` end to end: a real Prefect server and concurrency limit, 2-rank gloo MLP trials,
a SQLite MLflow store. Trials are tiny; what is asserted is how they were scheduled and ended."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.sweep import TRIAL_STATE_TAG, SweepConfig, sweep
from tests.conftest import REPO_ROOT
from trainflow import tracking
from trainflow.paths import run_output_dir
from trainflow.sweep import study_storage

pytestmark = pytest.mark.slow

# Tiny MLP trials on 2 CPU ranks; no retry, so a failing trial fails once.
TINY = {
    "num_train_samples": 512,
    "num_eval_samples": 64,
    "batch_size": 16,
    "max_steps": 30,
    "log_every": 5,
    "checkpoint_every": 0,
    "retries": 0,
    "stop_grace_s": 10,
}


def _client() -> MlflowClient:
    return tracking.store_client()


def _children(parent: str) -> list:
    client = _client()
    experiment = client.get_run(parent).info.experiment_id
    return client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent}'")


def _most_ranks_at_once(run_ids: list[str]) -> int:
    """The most ranks that trained at the same moment, from every rank's own step times."""
    events = []
    for run_id in run_ids:
        for log in (run_output_dir("mlp", run_id) / "samples").glob("rank_*.jsonl"):
            times = [json.loads(line)["time"] for line in log.read_text().splitlines()]
            events += [(min(times), 1), (max(times), -1)]
    running = most = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1])):
        running += change
        most = max(most, running)
    return most


def test_sweep_keeps_to_the_rank_budget_records_failures_and_promotes_the_best(prefect_api):
    # 2 ranks per trial, a budget of 2: trainings take turns. timeout_s=0.5 fails in the
    # launch (ranks cannot start that fast): those trials fail, the sweep goes on.
    config = SweepConfig(
        pipeline="mlp",
        space={"learning_rate": [0.01, 0.003], "timeout_s": [300, 0.5]},
        base={**TINY, "log_samples": True, "min_r2": 0.0, "registered_model_name": "mlp-sweep"},
        sampler="grid",
        trials=4,
        metric="eval_mse",
        mode="min",
        budget=2,
        pool="sweep-test-gpus",
        parallel=3,
        poll_s=0.5,
    )
    result = sweep(config)

    assert (result.num_complete, result.num_failed, result.num_pruned) == (2, 2, 0)
    client = _client()
    assert client.get_run(result.mlflow_run_id).info.status == "FINISHED"
    children = _children(result.mlflow_run_id)
    assert len(children) == 4
    by_status = {}
    for run in children:
        by_status.setdefault(run.info.status, []).append(run)
    assert len(by_status["FINISHED"]) == 2 and len(by_status["FAILED"]) == 2
    assert all(r.data.params["timeout_s"] == "0.5" for r in by_status["FAILED"])
    finished = [r.info.run_id for r in by_status["FINISHED"]]
    assert _most_ranks_at_once(finished) == 2

    best = min(by_status["FINISHED"], key=lambda r: r.data.metrics["eval_mse"])
    champion = client.get_model_version_by_alias("mlp-sweep", "champion")
    assert champion.run_id == best.info.run_id
    assert result.model_version == str(champion.version) and result.champion
    versions = client.search_model_versions("name='mlp-sweep'")
    assert len(versions) == 2  # the other trial stays registered, without the alias
    assert [v.aliases for v in versions if v.run_id != best.info.run_id] == [[]]


def test_the_median_pruner_stops_a_trial_that_learns_nothing(prefect_api):
    # Trial 0 learns; trial 1 (learning rate 1e-7) keeps its initial loss, above trial 0's at
    # every step: the median rule stops it long before its last step.
    steps = 2000
    config = SweepConfig(
        pipeline="mlp",
        space={"learning_rate": [0.01, 1e-7]},
        base={**TINY, "num_epochs": 150, "max_steps": steps, "log_every": 20, "min_r2": 2.0},
        sampler="grid",
        trials=2,
        metric="eval_mse",
        pruner="median",
        prune_startup_trials=1,
        budget=2,
        pool="sweep-test-gpus",
        parallel=1,
        poll_s=0.5,
    )
    result = sweep(config)

    assert (result.num_complete, result.num_pruned, result.num_failed) == (1, 1, 0)
    runs = {r.data.params["learning_rate"]: r for r in _children(result.mlflow_run_id)}
    good, pruned = runs["0.01"], runs["1e-07"]
    assert good.info.status == "FINISHED"
    assert pruned.info.status == "KILLED" and pruned.data.tags[TRIAL_STATE_TAG] == "pruned"
    history = _client().get_metric_history(pruned.info.run_id, "train_loss")
    assert max(m.step for m in history) < steps
    assert (
        max(m.step for m in _client().get_metric_history(good.info.run_id, "train_loss")) == steps
    )


def _study_has_a_finished_trial(parent: str) -> bool:
    """Whether the sweep has recorded a trial as finished (not only its MLflow run ended)."""
    import optuna

    db = run_output_dir("sweep", parent) / "study.db"
    if not db.exists():
        return False
    try:
        study = optuna.load_study(study_name=parent, storage=study_storage(db))
    except KeyError:  # not created yet
        return False
    return any(t.state.is_finished() for t in study.trials)


def _sweep_command(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.sweep", *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_a_stopped_sweep_resumes_without_running_finished_trials_again(prefect_api, tmp_path):
    base = {**TINY, "min_r2": 2.0}
    proc = _sweep_command(
        "mlp",
        "--space",
        json.dumps({"learning_rate": [0.01, 0.003, 0.001]}),
        "--sampler",
        "grid",
        "--trials",
        "3",
        "--base",
        json.dumps(base),
        "--budget",
        "2",
        "--pool",
        "sweep-test-gpus",
        "--parallel",
        "1",
        "--poll-s",
        "0.5",
    )
    client = _client()
    deadline = time.monotonic() + 240
    parent = None
    while time.monotonic() < deadline and proc.poll() is None:
        experiment = client.get_experiment_by_name("mlp")
        if experiment is not None:
            parents = client.search_runs(
                [experiment.experiment_id], "tags.`trainflow.sweep` = 'mlp'"
            )
            if parents:
                parent = parents[0].info.run_id
                if _study_has_a_finished_trial(parent):
                    break
        time.sleep(0.5)
    assert parent is not None and proc.poll() is None, proc.communicate()[0][-3000:]
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out[-3000:]
    # The id to continue with is the sweep's own, not its last trial's.
    assert f"Continue it with: python -m flows.sweep --resume {parent}" in out, out[-3000:]
    assert client.get_run(parent).info.status == "KILLED"
    before = {
        r.info.run_id: r.data.params["learning_rate"]
        for r in _children(parent)
        if r.info.status == "FINISHED"
    }
    assert 1 <= len(before) < 3

    resumed = _sweep_command("--resume", parent)
    out = resumed.communicate(timeout=400)[0]
    assert resumed.returncode == 0, out[-3000:]
    assert client.get_run(parent).info.status == "FINISHED"
    finished = [r for r in _children(parent) if r.info.status == "FINISHED"]
    rates = sorted(r.data.params["learning_rate"] for r in finished)
    assert rates == ["0.001", "0.003", "0.01"]  # each value trained to the end once
    assert set(before) <= {r.info.run_id for r in finished}
    assert Path(run_output_dir("sweep", parent) / "study.db").exists()


def test_a_sweep_whose_every_trial_failed_exits_1_naming_the_failures(prefect_api):
    # timeout_s=0.5 fails in the launch: ranks cannot start that fast.
    proc = _sweep_command(
        "mlp",
        "--space",
        json.dumps({"timeout_s": [0.5]}),
        "--trials",
        "1",
        "--base",
        json.dumps(TINY),
        "--pool",
        "sweep-test-gpus",
    )
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 1, out[-3000:]
    assert "python -m flows.sweep: error: no trial succeeded: trial 0: " in out, out[-3000:]
    assert "Traceback" not in out.split("=== sweep pipeline finished ===")[-1]
