"""Safe defaults: loopback-only servers, names that cannot escape, safe checkpoint loading."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from pydantic import ValidationError

from tests.conftest import REPO_ROOT
from trainflow.paths import safe_name
from trainflow.workloads.mlp import MLPConfig, load_model
from trainflow.workloads.transformer import TransformerConfig

FLOW_REPORTING_LISTENERS = textwrap.dedent(
    """
    import json, psutil
    from prefect import flow

    @flow
    def report():
        found = set()
        for proc in psutil.Process().children(recursive=True):
            try:
                for conn in proc.net_connections(kind="inet"):
                    if conn.status == psutil.CONN_LISTEN:
                        found.add(conn.laddr.ip)
            except psutil.Error:
                pass
        return sorted(found)

    print("LISTEN=" + json.dumps(report()))
    """
)


def test_local_prefect_server_started_by_a_run_listens_on_loopback_only(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    # Prefect's own temporary server (a plain flow call) waits 20 s by default: too short on a
    # busy 2-core machine migrating a fresh database.
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
    proc = subprocess.run(
        [sys.executable, "-c", FLOW_REPORTING_LISTENERS],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("LISTEN="))
    addresses = line.removeprefix("LISTEN=")
    assert addresses == '["127.0.0.1"]'


@pytest.mark.parametrize("name", ["../escape", "a/b", "/abs", ".hidden", "..", "", "x" * 200])
def test_names_that_could_escape_their_folder_are_rejected(name):
    with pytest.raises(ValueError, match="not a safe name"):
        safe_name(name, "registered_model_name")
    with pytest.raises(ValidationError, match="registered_model_name"):
        MLPConfig(registered_model_name=name)
    with pytest.raises(ValidationError, match="experiment_name"):
        MLPConfig(experiment_name=name)
    with pytest.raises(ValidationError, match="registered_model_name"):
        TransformerConfig(registered_model_name=name)


def test_ordinary_names_pass():
    for name in ("mlp", "sft-llama_3.2", "A1"):
        assert safe_name(name) == name


class Payload:
    """Anything but tensors: a weights-only load must refuse to build it."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_checkpoints_load_weights_only(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"net.0.weight": Payload()}, path)
    with pytest.raises(Exception, match="Weights only load failed"):
        load_model(MLPConfig(), path)


def test_runs_on_their_own_temporary_server_send_no_heartbeats_unless_asked(monkeypatch):
    from prefect.settings import Settings

    from flows.local_server import run_settings

    monkeypatch.delenv("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", raising=False)
    assert run_settings(Settings()) == {"flows.heartbeat_frequency": None}
    monkeypatch.setenv("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "60")
    assert run_settings(Settings()) == {}
