"""Runs against a team's stack: PostgreSQL, the Prefect and MLflow servers and the object store,
started by `python -m deployments.stack up` (S3: moto's server, the stand-in)."""

import json
import os
import subprocess
import sys

import boto3
import psutil
import pytest

from tests.processes import alive_pids
from tests.team.conftest import REPO_ROOT, parse_exports, stack_command

pytestmark = pytest.mark.slow


def _listening(pid: int) -> set[str]:
    """Addresses the process `pid` and its children listen on."""
    addresses = set()
    proc = psutil.Process(pid)
    for member in [proc, *proc.children(recursive=True)]:
        try:
            for conn in member.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    addresses.add(conn.laddr.ip)
        except psutil.Error:
            pass
    return addresses


def test_up_prints_both_uis_and_the_exports_and_every_service_listens_on_loopback(team_stack):
    out = team_stack["status"]
    exports = parse_exports(out)
    assert exports["PREFECT_API_URL"].startswith("http://127.0.0.1:")
    assert exports["MLFLOW_TRACKING_URI"].startswith("http://127.0.0.1:")
    assert "UI http://127.0.0.1:" in out and "stand-in" in out
    state = json.loads((team_stack["dir"] / "state.json").read_text())
    assert set(state["services"]) == {"postgres", "s3", "prefect", "mlflow", "worker"}
    for name, record in state["services"].items():
        assert psutil.pid_exists(record["pid"]), name
        if name != "worker":
            assert _listening(record["pid"]) == {"127.0.0.1"}, name
    # No password on any command line (other local users can read those).
    password = json.loads((team_stack["dir"] / "secrets.json").read_text())["db_password"]
    assert oct((team_stack["dir"] / "secrets.json").stat().st_mode & 0o777) == "0o600"
    for proc in psutil.process_iter(["cmdline"]):
        assert password not in " ".join(proc.info["cmdline"] or [])
    status = stack_command("status", team_stack["env"])
    assert status.returncode == 0, status.stdout + status.stderr


def _run(env: dict[str, str], *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _run_id(stdout: str) -> str:
    return next(
        line.split(":", 1)[1].strip()
        for line in stdout.splitlines()
        if line.startswith("MLflow run")
    )


def _objects(prefix: str) -> list[str]:
    client = boto3.client("s3")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket="trainflow", Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _postgres_rows(team_stack, database: str, query: str) -> list[tuple]:
    import psycopg

    password = json.loads((team_stack["dir"] / "secrets.json").read_text())["db_password"]
    state = json.loads((team_stack["dir"] / "state.json").read_text())
    with psycopg.connect(
        host="127.0.0.1",
        port=state["ports"]["postgres"],
        user="trainflow",
        password=password,
        dbname=database,
    ) as conn:
        return conn.execute(query).fetchall()


def test_an_sft_run_streams_its_dataset_from_the_bucket_and_is_tracked_by_the_servers(
    team_stack, stack_env
):
    """`flows.sft` on the stack: its dataset published to and streamed from the object store,
    its MLflow run, metrics and model in the server (artifacts in the bucket), its flow run in
    the Prefect server's PostgreSQL database."""
    done = _run(stack_env, "flows.sft", "--max-steps", "6", "--checkpoint-every", "0")
    run_id = _run_id(done.stdout)
    from mlflow import MlflowClient

    client = MlflowClient(stack_env["MLFLOW_TRACKING_URI"])
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert "eval_loss" in run.data.metrics
    assert client.search_model_versions(f"run_id='{run_id}'"), "no model version registered"
    datasets = _objects("datasets/")
    assert any(key.endswith(".mds.zstd") for key in datasets), datasets
    assert any(key.startswith("mlflow/") for key in _objects("mlflow/"))
    # Nothing of the dataset is published under the run's own home: it came from the bucket.
    assert not (
        stack_env and (os.path.isdir(os.path.join(stack_env["TRAINFLOW_HOME"], "datasets")))
    )
    rows = _postgres_rows(
        team_stack, "prefect", "SELECT state_type FROM flow_run WHERE name IS NOT NULL"
    )
    assert rows and ("COMPLETED",) in rows
    rows = _postgres_rows(
        team_stack, "mlflow", f"SELECT status FROM runs WHERE run_uuid='{run_id}'"
    )
    assert rows == [("FINISHED",)]


def test_a_deployment_runs_on_the_stacks_work_pool_worker(team_stack, stack_env):
    """prefect.yaml's `mlp/cpu-local`, deployed to the stack's Prefect server and started
    through its API, is run by the stack's process worker and tracked by its MLflow server."""
    _run(stack_env, "prefect", "--no-prompt", "deploy", "--name", "mlp/cpu-local", timeout=180)
    from prefect.deployments import run_deployment

    flow_run = run_deployment(
        "mlp/cpu-local", parameters={"config": {"max_steps": 20}}, timeout=300
    )
    assert flow_run.state.is_completed(), flow_run.state
    from mlflow import MlflowClient

    runs = MlflowClient(stack_env["MLFLOW_TRACKING_URI"]).search_runs(
        [e.experiment_id for e in MlflowClient().search_experiments()],
        filter_string="attributes.status = 'FINISHED'",
    )
    assert runs


def test_a_model_of_a_gigabyte_registers_and_loads_back_through_the_server_in_parts(
    team_stack, stack_env, tmp_path
):
    """1.14 GB of float32 weights through the proxied server: multipart upload (MLflow's default
    single PUT is what fails for users above ~800 MB), registered, loaded back bit-identical,
    and nothing of it left in the temp folder."""
    log = team_stack["dir"] / "logs" / "mlflow.log"
    before = log.read_text(errors="replace").count("/mlflow-artifacts/mpu/complete/")
    temp = tmp_path / "temp"
    temp.mkdir()
    done = _run(
        {**stack_env, "TMPDIR": str(temp)},
        *("benchmarks.large_model", "--server-only", "--name", "big"),
        timeout=500,
    )
    # torch's compile cache lives there by design, kept from run to run.
    left = [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == []
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["model_gb"] >= 1.0
    assert report["server"]["identical"] is True
    after = log.read_text(errors="replace").count("/mlflow-artifacts/mpu/complete/")
    assert after > before, "the weights did not go up in parts"


def test_down_stops_every_service_by_pid_and_up_finds_the_data_again(tmp_path):
    """A stack of its own: `down` stops what `up` started and keeps the data; `up` again has
    the MLflow experiment made before; `down --purge` leaves no process and no folder."""
    from tests.team.conftest import _skip_without_postgres

    _skip_without_postgres()
    env = {**os.environ, "TRAINFLOW_STACK_DIR": str(tmp_path / "stack")}
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        env.pop(key, None)
    try:
        up = stack_command("up", env)
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((tmp_path / "stack" / "state.json").read_text())
        pids = [r["pid"] for r in state["services"].values()]
        from mlflow import MlflowClient

        uri = parse_exports(up.stdout)["MLFLOW_TRACKING_URI"]
        MlflowClient(uri).create_experiment("kept-across-down")
        down = stack_command("down", env)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not alive_pids(pids)
        status = stack_command("status", env)
        assert status.returncode == 3 and "stopped" in status.stdout
        up = stack_command("up", env)
        assert up.returncode == 0, up.stdout + up.stderr
        assert parse_exports(up.stdout)["MLFLOW_TRACKING_URI"] == uri  # the same addresses
        assert MlflowClient(uri).get_experiment_by_name("kept-across-down") is not None
        pids = [
            r["pid"]
            for r in json.loads((tmp_path / "stack" / "state.json").read_text())[
                "services"
            ].values()
        ]
    finally:
        purge = stack_command("down", env, "--purge")
    assert purge.returncode == 0, purge.stdout + purge.stderr
    assert not alive_pids(pids)
    assert not (tmp_path / "stack").exists()


def test_up_applies_the_automation_that_crashes_runs_whose_process_died(team_stack, stack_env):
    """The stack's Prefect server holds the heartbeat automation (deployments.automations), so a
    flow run whose machine or process died ends Crashed rather than Running for good."""
    import asyncio

    from prefect import get_client

    from deployments.automations import CRASH_SILENT_RUNS

    async def read() -> list:
        async with get_client() as client:
            return await client.read_automations_by_name(CRASH_SILENT_RUNS)

    automations = asyncio.run(read())
    assert len(automations) == 1 and automations[0].enabled
