"""`python -m flows.axolotl`, `flows.llm_foundry`, `flows.unsloth` end to end on 2 CPU ranks: each
framework trains a tiny Llama with its own config and entry point in its own environment
(`.venvs/NAME`), and the pipeline prepares the data, evaluates and registers the result.

Each needs its environment, made by `bash scripts/setup-framework.sh NAME` (minutes, GBs of
downloads); without it the test is skipped, saying so.
"""

import json

import pytest

from flows import axolotl, llm_foundry, unsloth
from tests.conftest import REPO_ROOT
from tests.flows.test_mlp_flow import flow_run_artifacts
from trainflow import tracking
from trainflow.configs.frameworks import FRAMEWORKS
from trainflow.paths import run_output_dir, trainflow_home

pytestmark = pytest.mark.slow

SHORT = [
    *("--max-steps", "8", "--evaluation-num-samples", "16", "--evaluation-max-new-tokens", "4"),
]


def _needs_environment(name: str) -> None:
    python = FRAMEWORKS[name].default_python()
    if not python.exists():
        pytest.skip(f"{python} missing: `bash scripts/setup-framework.sh {name}` makes it")


@pytest.mark.parametrize(
    ("name", "pipeline"),
    [("axolotl", axolotl), ("llm-foundry", llm_foundry), ("unsloth", unsloth)],
    ids=["axolotl", "llm-foundry", "unsloth"],
)
def test_framework_trains_on_two_ranks_and_the_model_is_registered(
    prefect_api, name, pipeline, caplog
):
    _needs_environment(name)
    result = pipeline.main([*SHORT, "--registered-model-name", f"{name}-tiny"])
    logged = caplog.text
    assert result.technique == name and result.model_version == "1"
    m = result.metrics
    assert m["steps"] == 8 and m["train_loss"] > 0
    # Trained: the held-out loss fell from the base model's.
    assert m["eval_loss"] < m["untrained_loss"]

    client = tracking.store_client()
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["framework"] == name
    env_python = str(FRAMEWORKS[name].default_python())
    assert run.data.tags["framework_environment"].startswith("3.11")
    history = client.get_metric_history(result.mlflow_run_id, "train_loss")
    assert len(history) >= 2
    version = client.get_model_version(f"{name}-tiny", "1")
    assert version.tags["framework"] == name
    assert version.tags["framework_version"] not in ("", "None")  # the framework's own release
    assert version.tags["dataset_uri"] == result.dataset_uri
    # Both ranks ran, in the framework's environment, and their output reached the run log.
    assert "[rank 0]" in logged and "[rank 1]" in logged
    assert f"environment: {env_python}" in logged
    (launch,) = (trainflow_home() / "runs").iterdir()
    spec = json.loads((launch / "spec.json").read_text())
    assert spec["python"] == env_python and str(REPO_ROOT) in env_python
    # Rank 0 reported every step through the framework's own callbacks: the progress file
    # the pipeline follows, and its artifact, at 100%.
    out = run_output_dir(pipeline.__name__.removeprefix("flows."), result.mlflow_run_id)
    assert json.loads((out / tracking.PROGRESS_FILE).read_text()) == {"step": 8, "max_steps": 8}
    artifacts = flow_run_artifacts(result.prefect_flow_run_id)
    assert artifacts[f"{name}-progress"].data == 100.0
    assert f"{name}-summary" in artifacts
    assert any(k.startswith("framework_settings.") for k in run.data.params)  # its own file
