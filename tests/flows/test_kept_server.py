"""A Prefect server kept running between runs (`python -m flows.local_server start`): runs
without PREFECT_API_URL use it instead of starting their own, Ctrl-C in the terminal never
reaches it, `stop` ends its whole process group and never signals a process that merely has
its old PID."""

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests import processes
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

RUN_A_FLOW = (
    "from prefect import flow\n"
    "from flows.local_server import local_prefect_server\n"
    "@flow\n"
    "def hello(): return 'ran'\n"
    "with local_prefect_server() as url:\n"
    "    print('URL', url)\n"
    "    print('FLOW', hello())\n"
)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    return env


def _server(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.local_server", *args],
        cwd=REPO_ROOT,
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=180,
    )


def _run_a_flow(home: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", RUN_A_FLOW],
        cwd=REPO_ROOT,
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=180,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_runs_use_the_kept_server_until_it_is_stopped(tmp_path):
    home, port = tmp_path / "home", _free_port()
    home.mkdir()
    started = _server(home, "start", "--port", str(port))
    assert started.returncode == 0, started.stderr[-3000:]
    url = f"http://127.0.0.1:{port}/api"
    assert url in started.stdout and "stops it" in started.stdout
    state = json.loads((home / "trainflow-server.json").read_text())
    server = psutil.Process(state["pid"])
    try:
        assert os.getsid(server.pid) == server.pid  # a terminal's Ctrl-C never reaches it
        assert _server(home, "start").stdout == started.stdout  # already kept: left as it is
        status = _server(home, "status")
        assert status.returncode == 0 and url in status.stdout

        for _ in range(2):
            run = _run_a_flow(home)
            assert run.returncode == 0, run.stderr[-3000:]
            assert f"URL {url}" in run.stdout and "FLOW ran" in run.stdout
            assert "Starting temporary server" not in run.stderr
            assert processes.alive(server)  # the run left the kept server running
        with sqlite3.connect(home / "prefect.db") as db:
            assert db.execute("select count(*) from flow_run").fetchone()[0] == 2
    finally:
        stopped = _server(home, "stop")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert processes.survivors([server], 10) == []
    assert not _listening(port)
    assert not (home / "trainflow-server.json").exists()
    gone = _server(home, "status")
    assert gone.returncode == 3 and "no server is kept" in gone.stdout
    # Without a kept server, a run starts its own temporary one again.
    run = _run_a_flow(home)
    assert run.returncode == 0 and "Starting temporary server" in run.stderr, run.stderr[-3000:]


def test_stop_never_signals_a_process_that_reuses_the_recorded_pid(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state = {
            "pid": other.pid,
            "create_time": psutil.Process(other.pid).create_time() - 100.0,
            "url": f"http://127.0.0.1:{_free_port()}/api",
        }
        (tmp_path / "trainflow-server.json").write_text(json.dumps(state))
        stopped = _server(tmp_path, "stop")
        assert stopped.returncode == 0 and "no server is kept" in stopped.stdout
        time.sleep(0.2)
        assert other.poll() is None  # still running: not the server that was recorded
        assert _server(tmp_path, "status").returncode == 3
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()


def test_start_refuses_a_taken_port_naming_it(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _server(tmp_path, "start", "--port", str(port))
    assert out.returncode == 2, out.stderr
    assert f"--port: {port} is taken" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "trainflow-server.json").exists()
