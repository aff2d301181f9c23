"""Shared fixtures: one real Prefect server per test session, isolated state per test."""

import contextlib
import fcntl
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# A test run started in the background by a script (`pytest &`) inherits SIGINT ignored, and
# so would every process the tests start: the Ctrl-C the tests send as a terminal would (SIGINT
# to a foreground process group) would do nothing. The processes tests start are such
# foreground jobs: they get SIGINT's default again (an exec resets a handled signal, not an
# ignored one).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def free_port() -> int:
    """A loopback port that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call_on_nodes(call, nodes: int = 2) -> list:
    """`call()` from `nodes` threads at once, each standing in for one node's `.distributed()`
    on the same rendezvous; returns each node's return value. The first error is raised."""
    results: list = []
    errors: list = []

    def node() -> None:
        try:
            results.append(call())
        except BaseException as exc:  # raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=node) for _ in range(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def wait_until_serving(url: str, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    """Poll `url` until it answers; kill `proc` and raise naming `what` if it never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.2)


def pytest_collection_finish(session):
    """The modules the tests imported (torch, transformers, Prefect, MLflow) live as long as the
    session: out of the garbage collector's sight, each full collection (Python's own, and the
    tests' `gc.collect()` that closes a streaming dataset) does not walk them again."""
    gc.freeze()


def pytest_runtest_setup(item):
    """What the last test left alive joins them (its garbage is collected first): a test's
    full collections walk only what it made itself, not what every earlier test left behind."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def _flock(path: Path, mode: int):
    with open(path, "a") as file:
        fcntl.flock(file, mode)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _alone_when_marked(request, tmp_path_factory):
    """With tests in parallel (pytest-xdist's workers), a test marked `alone` runs while no other
    test does: it makes state that is machine-wide on purpose (stale `streaming` shared memory,
    which any run's clean-up removes). Every test holds a shared lock, an `alone` one the
    exclusive lock; a second lock, taken first, lets a waiting `alone` test in before new ones."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: tests run one at a time anyway
        yield
        return
    # The workers' temp folders share this parent, which pytest itself cleans up later.
    folder = tmp_path_factory.getbasetemp().parent
    alone = request.node.get_closest_marker("alone") is not None
    with contextlib.ExitStack() as held:
        with _flock(folder / f"trainflow-tests-{run}.turn", fcntl.LOCK_EX):
            held.enter_context(
                _flock(
                    folder / f"trainflow-tests-{run}.lock",
                    fcntl.LOCK_EX if alone else fcntl.LOCK_SH,
                )
            )
        yield


def pytest_sessionfinish(session):
    """Tests that open a `streaming` dataset themselves (not through a run, which cleans up
    after itself) leave its lock files in the temp folder; the last process to finish removes
    those no process uses any more, so the suite leaves nothing there."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller finishes last
        return
    from trainflow.data.shm import GRACE_S, clean_stale_streaming_state

    time.sleep(GRACE_S)
    clean_stale_streaming_state()


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    """Each test gets its own trainflow home and MLflow store; nothing leaks between tests."""
    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path / "trainflow-home"))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    if "mlflow" in sys.modules:
        # MLflow keeps the URI an earlier in-process run set; point it at this test's store.
        sys.modules["mlflow"].set_tracking_uri(store)
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def flush_prefect_logs() -> None:
    """Block until run logs buffered in this process have reached the Prefect server."""
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)


@contextlib.contextmanager
def prefect_server(home: Path):
    """A real `prefect server` (SQLite, its home `home`) on a loopback port, for as long as the
    context lasts: PREFECT_API_URL and PREFECT_HOME point at it, in this process's environment
    (so in every subprocess a test starts) and in Prefect's in-process settings."""
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": "",
        # The UI calls the API at this address (its default is port 4200).
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
    }
    log = open(home / "server.log", "wb")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    wait_until_serving(f"{url}/health", proc, 90, f"prefect server (see {home / 'server.log'})")
    old = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_HOME")}
    os.environ["PREFECT_API_URL"] = url
    os.environ["PREFECT_HOME"] = str(home)
    # Prefect reads its settings once at import; point the in-process client at the server too.
    from prefect.settings import PREFECT_API_URL, temporary_settings

    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        flush_prefect_logs()  # send buffered run logs while the server is still up
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        # The server runs in its own session: stop its whole process group.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def run_once_worker(env: dict, log: Any) -> subprocess.Popen:
    """A process worker on the cpu-local pool that runs what is scheduled now, then exits, in a
    session of its own, its output to the open file `log`.

    Prefect's process worker may leave each flow run's workspace manifest (its environment) in
    a temp folder: it is kept beside the log, in the test's own folder."""
    tmp = Path(log.name).parent / f"{Path(log.name).stem}-tmp"
    tmp.mkdir(exist_ok=True)
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "prefect", "worker", "start", "--pool", "cpu-local"),
            *("--run-once", "--type", "process"),
        ],
        cwd=REPO_ROOT,
        env={**env, "TMPDIR": str(tmp)},
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real `prefect server` (SQLite) on a loopback port, shared by the whole session.

    Sets PREFECT_API_URL for this process and for any subprocess a test starts.
    """
    with prefect_server(tmp_path_factory.mktemp("prefect-home")) as url:
        yield url
