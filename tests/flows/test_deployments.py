"""Deployments for real: prefect.yaml deployed to a real server, run by a real process worker.

One module-scoped run of `mlp/cpu-local` (triggered through the API, executed by
`prefect worker start`) is shared by the log, artifact and browser checks.
"""

import json
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

from tests.conftest import REPO_ROOT, run_once_worker

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
        "--name",
        "remote-call/cpu-local",
        env=env,
    )
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("mlp/cpu-local")
        flow_run = client.create_flow_run_from_deployment(
            deployment.id, parameters={"config": SMALL}
        )
    worker_log = open(work / "worker.log", "wb")  # noqa: SIM115 - closed below
    worker = run_once_worker(env, worker_log)
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
        "env": env,
        "work": work,
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


# A notebook cell: the function lives in __main__, so it travels by value, as from Jupyter.
REMOTE_CELL = """
import json, os
from trainflow import distributed, runtime

@distributed(gpus=2, gpu_type="cpu", remote=True)
def where(x):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([float(x + runtime.get_global_rank())])
    dist.all_reduce(total)
    dist.destroy_process_group()
    print("all-reduced", total.item(), flush=True)
    return {"rank": runtime.get_global_rank(), "pid": os.getpid(),
            "total": total.item()}

print("RESULT " + json.dumps({"caller": os.getpid(), "ranks": where.distributed(3)}))
"""


def test_remote_true_runs_the_call_on_the_deployment_and_returns_rank_values(deployed_run):
    """`remote=True` submits to remote-call/cpu-local; a process worker runs the ranks."""
    env = {**deployed_run["env"], "TRAINFLOW_REMOTE_DEPLOYMENT": "remote-call/cpu-local"}
    caller = subprocess.Popen(
        [sys.executable, "-c", REMOTE_CELL],
        env=env,
        cwd=deployed_run["work"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    worker_log = open(deployed_run["work"] / "remote-worker.log", "wb")  # noqa: SIM115
    worker = None
    try:
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("remote-call/cpu-local")
            deadline = time.monotonic() + 120
            while not client.read_flow_runs(
                flow_run_filter=FlowRunFilter(deployment_id={"any_": [deployment.id]})
            ):
                assert caller.poll() is None, caller.communicate()[0][-3000:]
                assert time.monotonic() < deadline, "the remote call created no flow run"
                time.sleep(0.5)
        worker = run_once_worker(env, worker_log)  # the call is waiting for it now
        out, _ = caller.communicate(timeout=400)
    finally:
        for proc in (caller, worker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        worker_log.close()
    assert caller.returncode == 0, out[-3000:]
    result = json.loads(out.split("RESULT ", 1)[1])
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert all(r["total"] == 3 + 4 for r in result["ranks"])  # (3+0) + (3+1), all-reduced
    assert all(r["pid"] != result["caller"] for r in result["ranks"])
    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(deployment_id={"any_": [deployment.id]})
        )
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
    assert run.state.is_completed()
    assert run.parameters["options"]["gpus"] == 2 and run.parameters["options"]["remote"] is False
    # the ranks ran in that flow run, and their output is in its logs
    assert any(log.message.startswith("[rank 1] all-reduced 7.0") for log in logs)
