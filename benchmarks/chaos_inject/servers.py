"""The tracking and orchestration servers of a chaos run, on loopback, stopped and started again
on the same port and the same database, as an outage or a redeploy would.

Each runs under `trainflow.launch.guard` in a session of its own: a signal the benchmark sends
to a run's process group never reaches it, and it dies with the benchmark however that ends.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

STOP_WAIT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One server command on a fixed loopback port; `url` answers once it is `start`ed."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int, log: Path):
        self.name, self.command, self.env, self.port, self.log = name, command, env, port, log
        self.proc: subprocess.Popen | None = None

    @property
    def health(self) -> str:
        raise NotImplementedError

    def start(self, timeout_s: float = 300.0) -> float:
        """Start it and wait until it answers; return the seconds that took."""
        started = time.monotonic()
        self.spawn()
        self.wait(started + timeout_s)
        return time.monotonic() - started

    def spawn(self) -> None:
        """Start it (`wait` for it to answer)."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainflow.launch.guard", str(os.getpid()), "--"]
                + self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait(self, deadline: float) -> None:
        """Wait until it answers; stop it and raise if it exits or `deadline` passes first."""
        assert self.proc is not None
        while True:
            try:
                with urllib.request.urlopen(self.health, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the {self.name} server did not start:\n{tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the server's whole process group (SIGTERM, then SIGKILL)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=STOP_WAIT_S)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


class MlflowServer(Server):
    """`mlflow server` on a SQLite store, serving the artifacts it stores in `root`."""

    def __init__(self, root: Path, env: dict[str, str]):
        root.mkdir(parents=True)
        port = free_port()
        command = [
            *(sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"),
            *("--port", str(port), "--workers", "1"),
            *("--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"),
            *("--artifacts-destination", str(root / "artifacts")),
        ]
        # Its GenAI job runner (unused here) leaves a queue folder in /dev/shm for good.
        env = {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        super().__init__("MLflow", command, env, port, root / "server.log")
        self.url = f"http://127.0.0.1:{port}"

    @property
    def health(self) -> str:
        return f"{self.url}/health"


class PrefectServer(Server):
    """`prefect server start` with its SQLite database in `home` (its PREFECT_HOME), started
    from the install's migrated empty database, without the UI and the background services."""

    def __init__(self, home: Path, env: dict[str, str]):
        from flows.local_server import database_template, seed_database

        home.mkdir(parents=True)
        port = free_port()
        database = f"sqlite+aiosqlite:///{home / 'prefect.db'}"
        seed_database(database, database_template())
        env = {
            **env,
            "PREFECT_HOME": str(home),
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": database,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "0",
        }
        env.pop("PREFECT_API_URL", None)
        command = [
            *(sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1"),
            *("--port", str(port), "--no-ui", "--no-services"),
        ]
        super().__init__("Prefect", command, env, port, home / "server.log")
        self.url = f"http://127.0.0.1:{port}/api"

    @property
    def health(self) -> str:
        return f"{self.url}/health"
