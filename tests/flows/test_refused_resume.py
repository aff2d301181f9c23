"""A `--resume` the run would refuse is refused by the command line before anything starts: one
line naming the run and why, exit 2, no traceback, no Prefect server, no launch, and the MLflow
run left as it was.

Real `python -m flows.<name>` processes against a real MLflow store (the test's own); the runs
they are asked to continue are opened and ended by `tracking.pipeline_run`, with the config a
pipeline saves beside them.
"""

import json
import os
import resource
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from trainflow import tracking
from trainflow.paths import RUN_CONFIG_FILE, run_output_dir
from trainflow.pipelines import pipeline

# A refusal reads the command line, the run's saved config and the MLflow store, before the
# flow's module imports Prefect: a few seconds of one core, most of them importing MLflow's
# client (more on a machine busy with other work). Counted in the command's CPU time; the
# server start and launch a refusal used to come after are well beyond it.
REFUSED_WITHIN_CPU_S = 12.0


def _run(name: str, status: str) -> str:
    """An MLflow run of pipeline `name` ended `status` (RUNNING: owned by this live process),
    its config saved in its output folder as the pipeline saves it."""
    config = _sweep_config() if name == "sweep" else pipeline(name).defaults()
    experiment = getattr(config, "experiment_name", name)
    client = tracking.store_client()
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    run_id = client.create_run(experiment_id, tags=tracking.owner_tags()).info.run_id
    if status != "RUNNING":
        client.set_terminated(run_id, status=status)
    folder = run_output_dir(name, run_id)
    folder.mkdir(parents=True)
    saved = config.model_dump(mode="json", exclude={"resume"})
    (folder / RUN_CONFIG_FILE).write_text(json.dumps(saved))
    return run_id


def _sweep_config():
    from flows.sweep import SweepConfig

    return SweepConfig(pipeline="mlp", space={"learning_rate": [0.001, 0.01]})


def _refused(pipeline_name: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run the command; assert it is refused as a usage error, quickly; its one error line."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-m", f"flows.{pipeline_name}", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    took = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "Starting temporary server" not in out, out[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"python -m flows.{pipeline_name}: error: "), lines[0]
    assert took < REFUSED_WITHIN_CPU_S, f"refused after {took:.1f} s of CPU"
    return lines[0]


def _status(run_id: str) -> str:
    return tracking.run_status(run_id)


@pytest.mark.parametrize("name", ["mlp", "transformer", "sft", "detection", "two_tower"])
def test_a_finished_run_is_refused_at_once_and_left_finished(name):
    finished = _run(name, "FINISHED")
    line = _refused(name, "--resume", finished)
    assert f"MLflow run {finished} already finished" in line
    assert _status(finished) == "FINISHED"


def test_an_unknown_run_or_another_pipelines_run_is_refused_in_one_line():
    line = _refused("mlp", "--resume", "no-such-run")
    assert "--resume no-such-run: no mlp run no-such-run was started" in line
    sft_run = _run("sft", "FAILED")
    line = _refused("mlp", "--resume", sft_run)
    assert f"no mlp run {sft_run} was started" in line


def test_a_changed_config_is_refused_naming_each_option_that_differs():
    failed = _run("transformer", "FAILED")
    line = _refused(
        "transformer", "--resume", failed, "--training-num-steps", "7", "--model-num-layers", "2"
    )
    assert "training.num_steps (60 -> 7)" in line and "model.num_layers (12 -> 2)" in line
    assert "training.seed" not in line  # only what differs
    assert _status(failed) == "FAILED"


def test_a_run_missing_from_its_store_is_refused_and_no_store_is_made(tmp_path):
    gone = _run("mlp", "FAILED")
    other = tmp_path / "other" / "mlflow.db"
    line = _refused("mlp", "--resume", gone, env={"MLFLOW_TRACKING_URI": f"sqlite:///{other}"})
    assert f"cannot resume MLflow run {gone}: no such run" in line
    assert not other.exists()


def test_a_run_still_running_here_is_refused_and_keeps_running():
    live = _run("mlp", "RUNNING")
    line = _refused("mlp", "--resume", live)
    assert f"cannot resume MLflow run {live}: it is still running (pid {os.getpid()}" in line
    assert _status(live) == "RUNNING"


def test_a_sweep_resume_is_refused_the_same_way():
    line = _refused("sweep", "--resume", "no-such-sweep")
    assert "no sweep run no-such-sweep was started" in line
    finished = _run("sweep", "FINISHED")
    line = _refused("sweep", "--resume", finished)
    assert f"MLflow run {finished} already finished" in line
    failed = _run("sweep", "FAILED")
    line = _refused("sweep", "--resume", failed, "--seed", "5")
    assert "seed (0 -> 5)" in line
