"""A team's load at once against a stack of its own (`benchmarks/stack_load.py`, smaller than the
documented run): a sweep of MLP trials under a rank budget, an SFT run and a two-tower run, all
started together. The S3 endpoint is moto's server, the stand-in."""

import json
import subprocess
import sys

import pytest

from tests.team.conftest import REPO_ROOT, _skip_without_postgres

pytestmark = pytest.mark.slow


def test_a_sweep_sft_and_two_tower_at_once_all_finish_registered_without_database_errors():
    _skip_without_postgres()
    done = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks.stack_load", "--target", "stack"),
            *("--trials", "4", "--budget", "2", "--sft", "1", "--two-tower", "1"),
            *("--mlp-steps", "20", "--sft-steps", "6", "--two-tower-steps", "10"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=580,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    stack = report["stack"]
    assert stack["exit_codes"] == {"sweep": 0, "sft-0": 0, "two_tower-0": 0}, done.stderr[-8000:]
    assert stack["mlflow_statuses"] == {"FINISHED": 1 + 4 + 1 + 1}
    assert stack["children_linked"] and stack["sweep_children"] == 4
    assert stack["pipeline_runs_without_version"] == 0 and stack["versions"] == 4 + 1 + 1
    assert set(stack["flow_run_states"]) == {"COMPLETED"} and stack["every_trial_listed"]
    assert stack["db_errors"] == {}
    assert done.returncode == 0
