"""A framework pipeline on the skeleton: its run's stop file ends it KILLED with nothing
registered, and `--resume RUN_ID` continues that MLflow run, training again from the start
(a framework cannot continue from a checkpoint of ours). Axolotl's tiny config, 2 CPU ranks,
its own environment (skipped without it, naming the command that makes it)."""

import json
import threading
import time
from pathlib import Path

import pytest

from flows import axolotl
from tests.flows.test_mlp_flow import flow_run_artifacts
from trainflow import tracking
from trainflow.configs.frameworks import FRAMEWORKS
from trainflow.errors import StopRequested
from trainflow.paths import STOP_FILE, trainflow_home

pytestmark = pytest.mark.slow

STEPS = 16
OPTIONS = [
    *("--max-steps", str(STEPS), "--registered-model-name", "axolotl-resumed"),
    *("--evaluation-num-samples", "16", "--evaluation-max-new-tokens", "4"),
]


def _stop_once_training(outputs: Path, stopped: list[Path], timeout_s: float = 600) -> None:
    """Create the run's stop file as soon as rank 0 has reported its first step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for progress in outputs.glob(f"*/{tracking.PROGRESS_FILE}"):
            (progress.parent / STOP_FILE).touch()
            stopped.append(progress.parent)
            return
        time.sleep(0.05)


def test_a_stop_file_ends_the_run_killed_and_resume_continues_it(prefect_api, caplog):
    python = FRAMEWORKS["axolotl"].default_python()
    if not python.exists():
        pytest.skip(f"{python} missing: `bash scripts/setup-framework.sh axolotl` makes it")
    outputs = trainflow_home() / "outputs" / "axolotl"
    stopped: list[Path] = []
    stopper = threading.Thread(target=_stop_once_training, args=(outputs, stopped))
    stopper.start()
    try:
        with pytest.raises(StopRequested, match="stopped on request"):
            axolotl.main(OPTIONS)
    finally:
        stopper.join()
    (folder,) = stopped
    run_id = folder.name
    client = tracking.store_client()
    assert client.get_run(run_id).info.status == "KILLED"
    assert client.search_model_versions("name='axolotl-resumed'") == []
    assert (folder / STOP_FILE).exists()
    progress = json.loads((folder / tracking.PROGRESS_FILE).read_text())
    # The stop lands within the launch's watch interval: on a fast machine the tiny run may
    # have finished its steps by then. Either way it ended KILLED, before registration.
    assert progress["max_steps"] == STEPS and progress["step"] <= STEPS

    result = axolotl.main(["--resume", run_id])
    printed = caplog.text
    assert result.mlflow_run_id == run_id and result.model_version == "1"
    assert f"MLflow run {run_id} continuing" in printed
    assert "Axolotl cannot continue from a checkpoint: it trains again from the start" in printed
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags[tracking.RESUMED_TAG]
    assert client.get_model_version("axolotl-resumed", "1").run_id == run_id
    assert result.metrics["steps"] == STEPS
    assert not (folder / STOP_FILE).exists()  # what stopped the first attempt is gone
    assert json.loads((folder / tracking.PROGRESS_FILE).read_text())["step"] == STEPS
    assert flow_run_artifacts(result.prefect_flow_run_id)["axolotl-progress"].data == 100.0
