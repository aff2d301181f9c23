"""A pipeline killed or stopped mid-training continues with `--resume RUN_ID`: from its last
checkpoint, in the same MLflow run, without preparing its data again, and ends registered.

Real `python -m flows.<name>` processes in their own session, real signals to the whole
process group, a real Prefect server and MLflow store.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO_ROOT
from trainflow import checkpoint, tracking
from trainflow.paths import trainflow_home

pytestmark = pytest.mark.slow


def _start(pipeline: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", f"flows.{pipeline}", *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives a command
    )


def _run(pipeline: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", f"flows.{pipeline}", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


def _run_dir(pipeline: str, proc: subprocess.Popen, timeout_s: float = 300) -> Path:
    deadline = time.monotonic() + timeout_s
    while True:
        found = list((trainflow_home() / "outputs" / pipeline).glob("*/config.json"))
        if found:
            return found[0].parent
        assert proc.poll() is None, proc.stdout.read()[-5000:]
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.2)


def _steps_done(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "progress.json").read_text())["step"]
    except (OSError, ValueError):
        return 0


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s=300) -> int:
    deadline = time.monotonic() + timeout_s
    while (done := _steps_done(run_dir)) < step:
        assert proc.poll() is None, proc.stdout.read()[-5000:]
        assert time.monotonic() < deadline, f"training never reached step {step}"
        time.sleep(0.05)
    return done


def _descendants(pid: int) -> list[psutil.Process]:
    """The process and every process it started, the launch agent's session included."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _wait_gone(procs: list[psutil.Process], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def _lose_the_machine(proc: subprocess.Popen) -> None:
    """SIGKILL the run's whole process group (nothing runs any cleanup) and assert every
    process of it is gone."""
    procs = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert _wait_gone(procs, 10) == []


def _logged_steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted({m.step for m in client.get_metric_history(run_id, key)})


def test_sft_killed_with_its_process_group_resumes_from_its_last_checkpoint(prefect_api):
    name = "sft-resume"
    args = [
        *("--max-steps", "120", "--checkpoint-every", "20", "--training-logging-steps", "10"),
        *("--evaluation-num-samples", "32", "--evaluation-max-new-tokens", "8"),
        *("--registered-model-name", name),
    ]
    first = _start("sft", *args)
    run_dir = _run_dir("sft", first)
    run_id = run_dir.name
    try:
        _wait_for_step(run_dir, 30, first)
        _lose_the_machine(first)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    latest = checkpoint.latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None
    resumed_at = checkpoint.read_meta(latest)["step"]
    assert resumed_at >= 20

    resumed_from_ms = time.time() * 1000
    out = _run("sft", "--resume", run_id)
    assert f"continuing training from {latest} (step {resumed_at})" in out
    assert f"resuming from {latest} at step {resumed_at}" in out
    assert "cache hit" in out  # the data was prepared by the first run; not again
    client = tracking.store_client()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # the same run, continued
    # The resumed process trained from the step after the checkpoint: the first loss it logged
    # is the first logging step after it.
    history = client.get_metric_history(run_id, "train_loss")
    after = sorted(m.step for m in history if m.timestamp >= resumed_from_ms)
    assert after[0] == resumed_at + 10
    assert _logged_steps(client, run_id, "train_loss") == list(range(10, 121, 10))  # no gap
    versions = client.search_model_versions(f"name='{name}'")
    assert [v.run_id for v in versions] == [run_id]
    assert versions[0].tags["mlflow_run_id"] == run_id


def test_mlp_sigterm_checkpoints_the_step_reached_and_resume_continues_from_it(prefect_api):
    name = "mlp-resume"
    args = [
        *("--num-epochs", "40", "--checkpoint-every", "100000", "--log-every", "5"),
        *("--registered-model-name", name, "--learning-rate", "0.003"),
    ]
    first = _start("mlp", *args)
    run_dir = _run_dir("mlp", first)
    run_id = run_dir.name
    try:
        _wait_for_step(run_dir, 30, first)
        os.killpg(first.pid, signal.SIGTERM)  # what systemd, Kubernetes and `timeout` send
        out, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode != 0
    client = tracking.store_client()
    assert client.get_run(run_id).info.status == "KILLED"
    assert client.search_model_versions(f"name='{name}'") == []
    # The stop wrote a checkpoint at the step reached (not one of the every-100000 ones).
    latest = checkpoint.latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None, out[-5000:]
    stopped_at = checkpoint.read_meta(latest)["step"]
    assert stopped_at >= 30 and stopped_at == _steps_done(run_dir)
    assert f"stopped after step {stopped_at}" in out
    assert not list((run_dir / "checkpoints").glob(".*partial"))

    out = _run("mlp", "--resume", run_id)
    assert f"resumed from {latest} at step {stopped_at}" in out
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["num_epochs"] == "40"  # its own config, not the defaults
    steps = _logged_steps(client, run_id, "train_loss")
    assert steps == sorted(set(range(5, steps[-1] + 1, 5)) | {steps[-1]})  # no gap
    assert [v.run_id for v in client.search_model_versions(f"name='{name}'")] == [run_id]


def test_a_retry_of_the_flow_run_continues_the_same_mlflow_run(prefect_api):
    from prefect import flow

    from flows.skeleton import tracked_run
    from trainflow.configs.mlp import MLPConfig
    from trainflow.pipelines import PIPELINES

    opened: list[str] = []

    @flow(retries=1, retry_delay_seconds=0)
    def lost_a_node_once(config: MLPConfig) -> str:
        with tracked_run(PIPELINES["mlp"].ranks, config) as run:
            opened.append(run.run_id)
            if len(opened) == 1:
                raise RuntimeError("the node went away")
        return run.run_id

    run_id = lost_a_node_once(MLPConfig(gpu_type="cpu"))
    assert opened == [run_id, run_id]
    client = tracking.store_client()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["trainflow.resumed"] == "1"
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_two_tower_sigterm_checkpoints_the_step_reached_and_resume_trains_only_the_rest(
    prefect_api,
):
    """The Lightning Trainer on our ranks: the stop checkpoint holds the loop and the loader's
    position, so the resumed run trains the steps after it, each once, and no step before."""
    name = "two-tower-resume"
    args = [
        *("--training-num-epochs", "3", "--checkpoint-every", "100000"),
        *("--training-log-samples", "--registered-model-name", name),
    ]
    first = _start("two_tower", *args)
    run_dir = _run_dir("two_tower", first)
    run_id = run_dir.name
    try:
        _wait_for_step(run_dir, 30, first)
        os.killpg(first.pid, signal.SIGTERM)
        out, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode != 0
    client = tracking.store_client()
    assert client.get_run(run_id).info.status == "KILLED"
    assert client.search_model_versions(f"name='{name}'") == []
    latest = checkpoint.latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None, out[-5000:]
    stopped_at = checkpoint.read_meta(latest)["step"]
    progress = json.loads((run_dir / "progress.json").read_text())
    assert 30 <= stopped_at < progress["max_steps"], out[-5000:]
    assert f"stop requested: stopped after step {stopped_at}; checkpoint {latest}" in out
    assert not list((run_dir / "checkpoints").glob(".*partial"))

    resumed_from_ms = time.time() * 1000
    out = _run("two_tower", "--resume", run_id)
    assert f"resuming from {latest} at step {stopped_at}" in out
    assert "cache hit" in out
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    # Each rank trained every step after the checkpoint once, and none before it: Lightning
    # restored the step and the loader's place in the epoch, not only the weights.
    samples = sorted((run_dir / "samples").glob("rank_*.jsonl"))
    assert len(samples) == 2
    for path in samples:
        steps = [json.loads(line)["step"] for line in path.open()]
        assert steps == list(range(stopped_at, progress["max_steps"])), path.name
    history = client.get_metric_history(run_id, "train_loss")
    assert min(m.step for m in history if m.timestamp >= resumed_from_ms) >= stopped_at
    logged = _logged_steps(client, run_id, "train_loss")
    gaps = [b - a for a, b in zip(logged, logged[1:], strict=False)]
    assert logged[0] < 10 and logged[-1] >= progress["max_steps"] - 10 and max(gaps) <= 10
    [version] = client.search_model_versions(f"name='{name}'")
    assert version.run_id == run_id
    assert client.get_model_version_by_alias(name, "champion").version == version.version
