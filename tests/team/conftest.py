"""The team stack for the tests: started once for the session by the command a user runs
(`python -m deployments.stack up`), shared by pytest-xdist's workers, stopped and deleted by the
last worker to finish with it (`down --purge`).

Its S3 endpoint is moto's server, the stand-in object store; everything else is the real thing:
Debian's PostgreSQL, `prefect server`, `mlflow server` and a Prefect process worker.
"""

import contextlib
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def stack_command(verb: str, env: dict[str, str], *args: str, timeout: float = 300):
    return subprocess.run(
        [sys.executable, "-m", "deployments.stack", verb, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def parse_exports(text: str) -> dict[str, str]:
    """The `export K=V` lines `up`, `status` and `env` print."""
    out = {}
    for line in text.splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            out[key] = value
    return out


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _skip_without_postgres() -> None:
    from deployments.stack_services import StackError, postgres_bin

    try:
        postgres_bin()
    except StackError as err:
        pytest.skip(f"no PostgreSQL on this machine: {err}")


@pytest.fixture(scope="session")
def team_stack(tmp_path_factory):
    """`{"dir", "env", "status"}` of the running stack: `env` holds what its `env` verb exports
    (the client settings), on top of this process's environment."""
    _skip_without_postgres()
    shared = tmp_path_factory.getbasetemp().parent
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "single")
    folder = shared / f"team-stack-{run}"
    users = shared / f"team-stack-{run}.users"
    base_env = {**os.environ, "TRAINFLOW_STACK_DIR": str(folder)}
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "TRAINFLOW_STACK_ARTIFACTS"):
        base_env.pop(key, None)
    with _locked(shared / f"team-stack-{run}.lock"):
        count = int(users.read_text() or 0) if users.exists() else 0
        up = stack_command("up", base_env)
        assert up.returncode == 0, up.stdout + up.stderr
        users.write_text(str(count + 1))
    try:
        yield {"dir": folder, "env": {**base_env, **parse_exports(up.stdout)}, "status": up.stdout}
    finally:
        with _locked(shared / f"team-stack-{run}.lock"):
            count = int(users.read_text()) - 1
            users.write_text(str(count))
            if count == 0:
                down = stack_command("down", base_env, "--purge")
                assert down.returncode == 0, down.stdout + down.stderr


@pytest.fixture
def stack_env(team_stack, tmp_path, monkeypatch):
    """This test's environment on the stack: its servers, its own TRAINFLOW_HOME, in this process
    too (for the MLflow and Prefect clients a test uses)."""
    env = {**team_stack["env"], "TRAINFLOW_HOME": str(tmp_path / "trainflow-home")}
    for key in (
        "PREFECT_API_URL",
        "MLFLOW_TRACKING_URI",
        "S3_ENDPOINT_URL",
        "AWS_ENDPOINT_URL",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_DEFAULT_REGION",
        "MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD",
        "TRAINFLOW_DATASETS",
        "TRAINFLOW_OUTPUT_ROOT",
    ):
        monkeypatch.setenv(key, env[key])
    import mlflow

    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
        yield env
