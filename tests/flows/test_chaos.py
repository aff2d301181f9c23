"""Many faults, one run, nothing lost: the short form of `benchmarks/chaos.py`.

A real `python -m flows.mlp` run against a real `mlflow server` and `prefect server` on
loopback, hit by 5 seeded faults (real signals to ranks, the agent and the process group, a
hung rank, a torn checkpoint, a full disk, server outages), then checked against an
uninterrupted run of the same command. It runs alone: it counts what is new in /tmp and
/dev/shm, which other tests would change meanwhile.
"""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.alone]

FAULTS, SEED = 5, 3


def test_five_faults_in_one_run_lose_nothing():
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks.chaos", "--pipeline", "mlp"),
            *("--faults", str(FAULTS), "--seed", str(SEED)),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.stdout.strip(), proc.stderr[-6000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    report = f"{json.dumps(row, indent=1)}\n{proc.stderr[-6000:]}"
    assert row["faults_injected"] == FAULTS, report
    assert row["faults_survived"] == row["faults_injected"], report
    assert row["weights_identical"] is True, report
    assert row["registered_version_identical"] is True, report
    assert row["versions_registered"] == 1, report
    assert row["mlflow_run_status"] == "FINISHED", report
    assert row["runs_left_running"] == 0, report
    assert row["processes_left"] == [], report
    assert row["files_left"] == [], report
    assert sum(k["injected"] for k in row["by_kind"].values()) == FAULTS, report
    assert proc.returncode == 0, report
