"""A run whose pipeline process was SIGKILLed shows FAILED, with the reason, as soon as any
trainflow command opens the store: `python -m trainflow runs`, or another pipeline's run.

A real `python -m flows.mlp` in its own session, SIGKILLed as a group mid-training, a real
Prefect server and MLflow store.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO_ROOT
from trainflow import tracking


def _reason(pid: int) -> str:
    return (
        f"the process that ran it (pid {pid} on {socket.gethostname()}) exited without ending "
        "the run (killed or crashed)"
    )


def _runs_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainflow", "runs", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _wait_for_step(proc: subprocess.Popen, out: Path, timeout_s: float = 300) -> None:
    home = Path(os.environ["TRAINFLOW_HOME"])
    deadline = time.monotonic() + timeout_s
    while not any(home.glob("outputs/mlp/*/progress.json")):
        assert proc.poll() is None, out.read_text()[-4000:]
        assert time.monotonic() < deadline, out.read_text()[-4000:]
        time.sleep(0.2)


@pytest.mark.slow
def test_a_sigkilled_pipeline_run_is_failed_by_the_next_command(tmp_path):
    out = tmp_path / "out.txt"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.mlp", "--num-epochs", "5000"],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    procs: list[psutil.Process] = []
    try:
        _wait_for_step(proc, out)
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group, mid-training
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for child in procs:  # the server and the launch live in sessions of their own
            with contextlib.suppress(psutil.Error):
                child.kill()
    client = tracking.store_client()
    experiment = client.get_experiment_by_name("mlp").experiment_id
    (run,) = client.search_runs([experiment])
    run_id = run.info.run_id
    assert run.info.status == "RUNNING"  # nobody was left to end it
    assert run.data.tags[tracking.OWNER_PID_TAG] == str(proc.pid)

    listed = _runs_command()
    assert listed.returncode == 0, listed.stderr
    assert f"marked FAILED: MLflow run {run_id}" in listed.stderr
    (line,) = [row for row in listed.stdout.splitlines() if row.startswith(run_id)]
    assert " FAILED " in line and f"pid {proc.pid} on {socket.gethostname()}" in line
    killed = client.get_run(run_id)
    assert killed.info.status == "FAILED"
    assert killed.data.tags[tracking.FAILURE_REASON_TAG] == _reason(proc.pid)
    assert "marked FAILED" not in _runs_command("--status", "FAILED").stderr  # once only


def _orphan(experiment: str) -> tuple[str, int]:
    """A RUNNING run of `experiment` whose owner (a process of this host) has exited."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    client = tracking.store_client()
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    tags = {
        tracking.OWNER_HOST_TAG: socket.gethostname(),
        tracking.OWNER_PID_TAG: str(dead.pid),
        tracking.OWNER_START_TAG: "1.0",
    }
    return client.create_run(experiment_id, tags=tags).info.run_id, dead.pid


def test_another_pipelines_run_fails_the_stale_runs_of_every_experiment():
    stale, pid = _orphan("sft")
    with tracking.pipeline_run("mlp", "next", params={}):
        pass
    run = tracking.store_client().get_run(stale)
    assert run.info.status == "FAILED"
    assert run.data.tags[tracking.FAILURE_REASON_TAG] == _reason(pid)


def test_the_runs_command_lists_and_filters_runs_and_makes_no_store(tmp_path):
    listed = _runs_command()
    assert listed.returncode == 0 and listed.stdout.startswith("run id"), listed.stderr
    db = Path(tracking.tracking_uri().removeprefix("sqlite:///"))
    assert not db.exists()
    with tracking.pipeline_run("mlp", "done", params={}) as done:
        pass
    stale, _ = _orphan("two_tower")
    listed = _runs_command("--experiment", "mlp")
    assert done in listed.stdout and stale not in listed.stdout
    listed = _runs_command("--status", "FAILED")
    assert stale in listed.stdout and done not in listed.stdout
    missing = _runs_command("--experiment", "nope")
    assert missing.returncode == 2 and "no experiment 'nope'" in missing.stderr
    helped = _runs_command("--help")
    assert "--experiment" in helped.stdout and "--status" in helped.stdout
