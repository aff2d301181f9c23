"""Deployments for real: prefect.yaml deployed to a real server, run by a real process worker.

One module-scoped run of `mlp/cpu-local` (triggered through the API, executed by
`prefect worker start`) is shared by the log, artifact and browser checks.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.exceptions import PrefectHTTPStatusError

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT_DIR = REPO_ROOT / "test-output"
SMALL = {"gpus": 2, "gpu_type": "cpu", "num_epochs": 1, "registered_model_name": "mlp-deployed"}


def _cli(*args: str, env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def deployed_run(prefect_api, tmp_path_factory):
    """Deploy mlp/cpu-local, trigger it through the API, let a process worker run it."""
    work = tmp_path_factory.mktemp("deployed")
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}",
        "TRAINFLOW_HOME": str(work / "home"),
    }
    _cli("work-pool", "create", "cpu-local", "--type", "process", "--overwrite", env=env)
    template = REPO_ROOT / "deployments" / "k8s-gpu-job-template.json"
    _cli(
        "work-pool",
        "create",
        "k8s-gpu",
        "--type",
        "kubernetes",
        "--base-job-template",
        str(template),
        "--overwrite",
        env=env,
    )
    _cli(
        "--no-prompt",
        "deploy",
        "--name",
        "mlp/cpu-local",
        "--name",
        "mlp/h100",
        "--name",
        "transformer/cpu-local",
        env=env,
    )
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("mlp/cpu-local")
        flow_run = client.create_flow_run_from_deployment(
            deployment.id, parameters={"config": SMALL}
        )
    worker_log = open(work / "worker.log", "wb")  # noqa: SIM115 - closed below
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefect",
            "worker",
            "start",
            "--pool",
            "cpu-local",
            "--run-once",
            "--type",
            "process",
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=worker_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 400
        with get_client(sync_client=True) as client:
            while True:
                state = client.read_flow_run(flow_run.id).state
                if state and state.is_final():
                    break
                assert time.monotonic() < deadline, "deployed run did not finish in time"
                time.sleep(2)
        worker.wait(timeout=60)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, 15)
            worker.wait(timeout=30)
        worker_log.close()
    yield {
        "flow_run_id": flow_run.id,
        "state": state,
        "deployment": deployment,
        "worker_log": work / "worker.log",
        "api": prefect_api,
    }


def test_deployed_run_completes_with_rank_logs_and_artifacts(deployed_run):
    assert deployed_run["state"].is_completed(), deployed_run["worker_log"].read_text()[-3000:]
    flow_run_id = deployed_run["flow_run_id"]
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        )
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    messages = [log.message for log in logs]
    assert any(m.startswith("[rank 1] ") for m in messages), messages[:50]
    assert {"rank-logs", "mlp-summary"} <= {a.key for a in artifacts}


def test_server_side_schema_rejects_bad_input_naming_the_field(deployed_run):
    deployment_id = deployed_run["deployment"].id
    bad = [
        ({"config": {"gpus": 0}}, "config.gpus"),
        ({"config": {"num_epochs": -1}}, "config.num_epochs"),
        ({"config": {"technique": "zero4"}}, "'technique' was unexpected"),
        ({"config": {"registered_model_name": "../escape"}}, "config.registered_model_name"),
    ]
    with get_client(sync_client=True) as client:
        before = len(client.read_flow_runs())
        for parameters, field in bad:
            with pytest.raises(PrefectHTTPStatusError) as info:
                client.create_flow_run_from_deployment(deployment_id, parameters=parameters)
            assert field in info.value.response.text
        transformer = client.read_deployment_by_name("transformer/cpu-local")
        for technique in ({"name": "zero4"}, {"name": "deepspeed", "zero_stage": 5}):
            with pytest.raises(PrefectHTTPStatusError) as info:
                client.create_flow_run_from_deployment(
                    transformer.id, parameters={"config": {"technique": technique}}
                )
            assert "config.technique" in info.value.response.text
        assert len(client.read_flow_runs()) == before  # nothing was created for a worker


@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="Debian's chromium is not installed "
    "(scripts/setup.sh --with-browser installs it where apt-get is allowed)",
)
def test_prefect_ui_shows_the_run_state_and_artifact(deployed_run):
    from playwright.sync_api import sync_playwright

    ui = deployed_run["api"].removesuffix("/api")
    SCREENSHOT_DIR.mkdir(exist_ok=True)
    shot = SCREENSHOT_DIR / "prefect-ui-flow-run.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM),
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{ui}/runs/flow-run/{deployed_run['flow_run_id']}")
            try:
                page.get_by_text("Completed").first.wait_for(timeout=60_000)
                page.locator("#artifacts").click()  # the run page's Artifacts tab
                # The summary artifact's card: its description appears only on the tab.
                page.get_by_text("MLP pipeline", exact=True).first.wait_for(timeout=30_000)
                assert page.get_by_text("mlp-summary").count() >= 1
            finally:
                page.screenshot(path=str(shot), full_page=True)  # kept for a look, pass or fail
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000


def test_launch_flow_sizes_the_run_before_it_starts(deployed_run):
    from flows.launch import launch

    launched = launch("mlp", {"gpus": 4, "gpu_type": "H100", "num_epochs": 2})
    assert launched.deployment == "mlp/h100"
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(launched.flow_run_id)
        deployment = client.read_deployment(run.deployment_id)
    assert deployment.name == "h100" and deployment.work_pool_name == "k8s-gpu"
    assert run.job_variables == {
        "gpus_per_node": 4,
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    }
    assert run.parameters["config"]["gpus"] == 4
    assert run.state.is_scheduled()  # waiting for a GPU worker; nothing ran here
