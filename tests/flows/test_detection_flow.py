"""`python -m flows.detection` end to end: real Prefect server, 2 gloo ranks, real MDS shards,
temporary MLflow store; and bad input refused before anything starts."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from flows.detection import PLOT_FILE, detection
from tests.conftest import REPO_ROOT
from trainflow import tracking
from trainflow.configs.detection import DetectionConfig
from trainflow.data.shapes import ShapesSpec, render
from trainflow.paths import trainflow_home


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.detection", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_detection_pipeline_registers_a_model_that_finds_the_shapes(prefect_api):
    proc = _run("--registered-model-name", "det-e2e")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert re.search(r"Model +: det-e2e version 1", out)
    client = tracking.store_client()
    version = client.get_model_version("det-e2e", "1")
    run = client.get_run(version.run_id)
    metrics = run.data.metrics
    assert run.info.status == "FINISHED"
    assert metrics["eval_map"] >= 0.2
    assert metrics["eval_map"] >= metrics["untrained_map"] + 0.15
    assert metrics["eval_map_50"] >= metrics["untrained_map_50"] + 0.25
    assert version.tags["technique"] == "ddp" and version.tags["world_size"] == "2"
    assert version.tags["dataset_uri"].startswith(str(trainflow_home() / "datasets"))
    assert PLOT_FILE in [a.path for a in client.list_artifacts(run.info.run_id)]
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert history[-1].value < history[0].value

    import mlflow.pytorch

    pixels, boxes, labels = render(ShapesSpec(), np.random.default_rng([0, 1, 0]))
    image = (torch.from_numpy(pixels).permute(2, 0, 1).float() / 255)[None]
    found = mlflow.pytorch.load_model("models:/det-e2e/1")(image)[0]
    found = found[found[:, 4] >= 0.3]  # (x1, y1, x2, y2, score, label), best first
    assert len(found) >= 1
    # The most confident box lies on one of the drawn objects.
    x1, y1, x2, y2 = found[0, :4].tolist()
    ious = []
    for bx1, by1, bx2, by2 in boxes.tolist():
        inter = max(0, min(x2, bx2) - max(x1, bx1)) * max(0, min(y2, by2) - max(y1, by1))
        union = (x2 - x1) * (y2 - y1) + (bx2 - bx1) * (by2 - by1) - inter
        ious.append(inter / union)
    assert max(ious) >= 0.5, (found[:3], boxes, labels)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data-num-classes", "0"], "--data-num-classes: Input should be greater than"),
        (["--data-num-eval-images", "0"], "--data-num-eval-images: Input should be greater than"),
        (["--data-image-size", "16"], "--data-image-size: Input should be greater than"),
        (
            ["--data-num-eval-images", "1", "--data-num-classes", "4"],
            "data.num_eval_images=1: the held-out images show no object of class(es)",
        ),
    ],
    ids=["zero-classes", "empty-split", "image-too-small", "class-never-held-out"],
)
def test_bad_input_is_refused_before_anything_starts(args, message):
    proc = _run(*args)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not trainflow_home().exists()  # no generated data, datasets or run folders
    assert not os.path.exists(os.environ["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///"))


def test_flow_refuses_a_config_its_check_rejects_before_the_mlflow_run(prefect_api):
    config = DetectionConfig(data={"num_eval_images": 1, "num_classes": 4})
    with pytest.raises(ValueError, match=r"data\.num_eval_images=1"):
        detection(config)
    client = tracking.store_client()
    experiment = client.get_experiment_by_name("detection")
    assert experiment is None or client.search_runs([experiment.experiment_id]) == []
    assert not (trainflow_home() / "runs").exists()
    assert not (trainflow_home() / "sources").exists()
