"""The temporary Prefect server of `python -m flows.<name>`, stopped however the run ends.

Without `PREFECT_API_URL`, Prefect starts a temporary server of its own as a plain child of
the flow's process. A terminal's Ctrl-C (sent to the whole foreground process group) kills it
at once, and the flow engine then retries its state updates against it for minutes; a flow
process killed outright leaves it behind, still listening.

`local_prefect_server` starts the same server (Prefect's own uvicorn command and settings,
database under `PREFECT_HOME`) under `trainflow.launch.guard`, in a session of its own: it
never gets the terminal's signals, so the flow can still record how it ended, and the guard
stops it when the flow's process dies. This process and its children are pointed at it (the
in-process settings and `PREFECT_API_URL`), and it is stopped when the context exits.

A server on a new SQLite database first migrates it: about 6 s of the 9 s a first run's server
takes to answer on 2 cores. The install migrates one empty database per environment and
Prefect version (`python -m flows.local_server make-template`, run by `scripts/setup.sh`), and
a server whose database file does not exist yet starts on a copy of it.

A server can also be kept running between runs, owned by the user: `python -m
flows.local_server start` starts one on this `PREFECT_HOME` (with its UI), `stop` stops it and
`status` says where it is. Runs without `PREFECT_API_URL` then use it instead of starting
their own, which saves the server's start (its imports: about 3.5 s of a core) and its stop
on every run, and its UI shows every run since. Nothing starts one behind the user's back:
without `start`, each run has its temporary server, gone when the run ends.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import prefect
import psutil
from prefect.logging import get_logger
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

from trainflow.compat import prefect as prefect_compat
from trainflow.launch.processes import stop_process_group

STOP_WAIT_S = 10.0
STARTUP_TIMEOUT_S = 90.0  # unless PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS is set
_START_ATTEMPTS = 3

logger = get_logger()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_command(port: int) -> list[str]:
    """What Prefect runs for its temporary server (`SubprocessASGIServer`), on `port`, with
    Prefect's app built by `flows.server_app` (the same app, its imports without the cyclic
    collector)."""
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        str(Path(__file__).resolve().parents[1]),
        "--factory",
        "flows.server_app:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]


def _server_env() -> dict[str, str]:
    return {
        # A server registers every installed collection's block types as it starts, importing
        # each collection to find them (about 1 s warm, 4 s on a new database on 2 cores,
        # prefect-kubernetes alone 1.7 s). The temporary server serves one run, which uses no
        # blocks; `prefect server start` on the same home registers them at its own start, and
        # a block saved through this one registers its type then. Set either to override.
        "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "0",
        "PREFECT_SERVER_MEMOIZE_BLOCK_AUTO_REGISTRATION": "0",
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        **prefect_compat.temporary_server_env(),
        **get_current_settings().to_environment_variables(exclude_unset=True),
    }


def database_template() -> Path:
    """Where this environment keeps an empty database migrated by its Prefect version."""
    return Path(sys.prefix) / "share" / "trainflow" / f"prefect-{prefect.__version__}.db"


_SQLITE = "sqlite+aiosqlite:///"


def make_database_template(template: Path | None = None) -> Path:
    """Migrate an empty Prefect database into `template` (default `database_template()`).

    Prefect's own `prefect server database upgrade`, in a process pointed at a new file in a
    temporary folder beside `template`, then moved into place whole: a template is never
    half-written. Kept as it is when it exists.
    """
    template = template or database_template()
    if template.is_file():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".prefect-db-", dir=template.parent) as tmp:
        database = Path(tmp) / "prefect.db"
        env = {k: v for k, v in os.environ.items() if "DATABASE_CONNECTION_URL" not in k}
        env.update(
            PREFECT_HOME=tmp,
            PREFECT_SERVER_DATABASE_CONNECTION_URL=f"{_SQLITE}{database}",
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
        )
        subprocess.run(
            [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        os.replace(database, template)
    return template


def sqlite_file(connection_url: str) -> Path | None:
    """The file of a SQLite database URL (Prefect's default is `<home>/prefect.db`); None for
    another database, an in-memory one or a URL with options."""
    if not connection_url.startswith(_SQLITE) or "?" in connection_url:
        return None
    path = connection_url.removeprefix(_SQLITE)
    return None if ":memory:" in path else Path(path)


def seed_database(connection_url: str, template: Path) -> Path | None:
    """Copy `template` to the server's SQLite file if that file does not exist yet; returns it
    if it was seeded. The copy is linked into place only where no file is, so a database that
    appeared meanwhile is never replaced."""
    database = sqlite_file(connection_url)
    if database is None or database.exists() or not template.is_file():
        return None
    database.parent.mkdir(parents=True, exist_ok=True)
    partial = database.with_name(f".{database.name}.{os.getpid()}.partial")
    shutil.copyfile(template, partial)
    try:
        os.link(partial, database)
    except FileExistsError:
        return None
    finally:
        partial.unlink()
    return database


def _start_guarded(port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainflow.launch.guard",
            str(os.getpid()),
            "--",
            *_server_command(port),
        ],
        env=_server_env(),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _startup_timeout_s(settings: Any) -> float:
    """Prefect's startup timeout when the user set one, else `STARTUP_TIMEOUT_S`.

    Prefect's own default (20 s) is too short for a fresh database migrated on a busy 2-core
    machine while the run's ranks or other runs start beside it.
    """
    ephemeral = settings.server.ephemeral
    if "startup_timeout_seconds" in ephemeral.model_fields_set:
        return float(ephemeral.startup_timeout_seconds)
    return STARTUP_TIMEOUT_S


def _wait_healthy(url: str, guard: subprocess.Popen, timeout_s: float) -> bool:
    """True once `url/health` answers; False if the server exited first (port taken)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if guard.poll() is not None:
            return False
        if _answers(url):
            return True
        time.sleep(0.1)
    raise RuntimeError(
        f"the temporary Prefect server on {url} did not answer within {timeout_s:g}s "
        "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)"
    )


def stop_server(guard: subprocess.Popen, wait_s: float = STOP_WAIT_S) -> None:
    """SIGTERM the server's process group, SIGKILL it if it is still there after `wait_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(guard.pid, signal.SIGTERM)
    try:
        guard.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(guard.pid, signal.SIGKILL)
        guard.wait()


def _flush_to_server(timeout_s: float = 5.0) -> None:
    """Send the run logs and events still buffered in this process while the server is up."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout_s)


def _start_lock(home: Path, timeout_s: float) -> Any:
    """An inter-process lock held while a temporary server on `home` starts."""
    from filelock import FileLock

    home.mkdir(parents=True, exist_ok=True)
    return FileLock(str(home / ".temporary-server-start.lock"), timeout=timeout_s)


@contextlib.contextmanager
def local_prefect_server() -> Iterator[str | None]:
    """Run a temporary Prefect server for this process; yield its API URL once it answers.

    With `PREFECT_API_URL` set (or temporary servers turned off) nothing is started and the
    configured URL (or None) is yielded: flows use the server they are pointed at.
    """
    with starting_prefect_server() as ready:
        yield ready()


def run_settings(settings: Any) -> dict[str, Any]:
    """What changes for a run on its own temporary server: no flow-run heartbeats, unless
    they were asked for (`PREFECT_FLOWS_HEARTBEAT_FREQUENCY`).

    Heartbeats let a server tell a crashed flow run from a slow one; this server ends with
    the process. And stopping the heartbeat thread at the end of a flow run takes up to a
    second (it sleeps in whole seconds): for the pipeline and again for its technique's
    subflow.
    """
    if "heartbeat_frequency" in settings.flows.model_fields_set:
        return {}
    return {"flows.heartbeat_frequency": None}


@contextlib.contextmanager
def starting_prefect_server() -> Iterator[Callable[[], str | None]]:
    """Start a temporary Prefect server for this process; yield a call that waits for it.

    The server starts at once and this process goes on (checking its config, importing what
    the run needs) while it migrates its database and loads; the yielded call returns the API
    URL once the server answers, starting it again on another port if that one was taken.
    Nothing in this process may talk to Prefect before that call returns. With
    `PREFECT_API_URL` set (or temporary servers turned off) nothing is started.
    """
    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        yield lambda: settings.api.url
        return
    kept = kept_server_url(Path(settings.home))
    if kept is not None:
        logger.info("Using the kept server on %s", kept.removesuffix("/api"))
        with _pointed_at(kept, run_settings(settings)):
            yield lambda: kept
            _flush_to_server()
        return
    timeout_s = _startup_timeout_s(settings)
    old_env = os.environ.get("PREFECT_API_URL")
    server = _Starting(Path(settings.home), timeout_s)
    settings_in_use = contextlib.ExitStack()

    updates = run_settings(settings)

    def point_at(url: str) -> None:
        os.environ["PREFECT_API_URL"] = url  # processes this run starts agree
        settings_in_use.enter_context(temporary_settings(updates={PREFECT_API_URL: url, **updates}))

    def ready() -> str:
        started_on = server.url
        url = server.ready()
        if url != started_on:  # started again on another port
            point_at(url)
        return url

    try:
        with settings_in_use:
            point_at(server.start())
            try:
                yield ready
            finally:
                if server.answered:
                    _flush_to_server()
    finally:
        if old_env is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = old_env
        server.stop()


@contextlib.contextmanager
def _pointed_at(url: str, updates: dict[str, Any]) -> Iterator[None]:
    """This process (its settings and `PREFECT_API_URL`, for the processes it starts) pointed
    at the server on `url` for as long as the context lasts."""
    old_env = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    try:
        with temporary_settings(updates={PREFECT_API_URL: url, **updates}):
            yield
    finally:
        if old_env is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = old_env


KEPT_STATE = "trainflow-server.json"
KEPT_LOG = "trainflow-server.log"


def _kept_process(home: Path) -> tuple[psutil.Process, str] | None:
    """The kept server's process on `home` and its API URL, if `start` left one that runs (the
    same process: its start time is the recorded one, so a reused PID is never taken for it)."""
    import json

    try:
        state = json.loads((home / KEPT_STATE).read_text())
        proc = psutil.Process(int(state["pid"]))
        if abs(proc.create_time() - float(state["create_time"])) > 0.01:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc, str(state["url"])
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return None


def _answers(url: str, timeout_s: float = 2.0, path: str = "health") -> bool:
    """Whether the server on API `url` answers `path` with 200."""
    try:
        with urllib.request.urlopen(f"{url}/{path}", timeout=timeout_s) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def kept_server_url(home: Path) -> str | None:
    """The API URL of the server `start` keeps running on `home`, if it runs and answers."""
    found = _kept_process(home)
    if found is None or not _answers(found[1]):
        return None
    return found[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_kept_server(home: Path, port: int | None = None, ui: bool = True) -> str:
    """Start a Prefect server on `home` that outlives this process, on 127.0.0.1; its API URL.

    It runs in a session of its own (a terminal's Ctrl-C never reaches it), logs to
    `home/trainflow-server.log`, and is recorded in `home/trainflow-server.json` (PID and start
    time) for `stop`. A server already kept on `home` is left as it is.

    Raises:
        ValueError: `port` is taken (a usage error: name another).
        RuntimeError: the server exited or did not answer within its startup timeout.
    """
    import json

    running = kept_server_url(home)
    if running is not None:
        return running
    settings = get_current_settings()
    timeout_s = _startup_timeout_s(settings)
    with _start_lock(home, timeout_s):
        if port is None:  # Prefect's own port when it is free, as `prefect server start`
            preferred = int(settings.server.api.port)
            port = preferred if _port_free(preferred) else _free_port()
        if not _port_free(port):
            raise ValueError(f"--port: {port} is taken on 127.0.0.1; name another")
        url = settings.server.database.connection_url
        if url is not None:
            seed_database(url.get_secret_value(), database_template())
        env = prefect_compat.kept_server_env(
            {
                **_server_env(),
                "PREFECT_UI_ENABLED": "1" if ui else "0",
                "PREFECT_SERVER_API_HOST": "127.0.0.1",
                "PREFECT_SERVER_API_PORT": str(port),
            }
        )
        api = f"http://127.0.0.1:{port}/api"
        with (home / KEPT_LOG).open("ab") as log:
            server = subprocess.Popen(
                _server_command(port),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = psutil.Process(server.pid)
        state = {"pid": server.pid, "create_time": proc.create_time(), "url": api}
        (home / KEPT_STATE).write_text(json.dumps(state))
        deadline = time.monotonic() + timeout_s
        while not _answers(api, timeout_s=1.0):
            if server.poll() is not None or time.monotonic() > deadline:
                stop_kept_server(home)
                raise RuntimeError(
                    f"the Prefect server did not start on {api}; see {home / KEPT_LOG}"
                )
            time.sleep(0.1)
        # Ask what every client asks first (the API version): the first API request a Prefect
        # server answers builds its routes' state, about half a second of a core, which a kept
        # server then pays here, once, and not in the first run that uses it.
        _answers(api, timeout_s=30, path="admin/version")
    return api


def stop_kept_server(home: Path) -> bool:
    """Stop the server kept on `home` (its whole process group); whether one was running."""
    found = _kept_process(home)
    (home / KEPT_STATE).unlink(missing_ok=True)
    if found is None:
        return False
    stop_process_group(found[0].pid, STOP_WAIT_S)
    return True


class _Starting:
    """One temporary server: started, waited for (on a fresh port if its own was taken), stopped.

    A server migrates its database as it starts; two starting together on one fresh
    PREFECT_HOME race there ("duplicate column name"). Starts on one home take turns: the
    lock is held from the start until the server answers.
    """

    def __init__(self, home: Path, timeout_s: float):
        self.timeout_s = timeout_s
        self.lock = _start_lock(home, timeout_s * _START_ATTEMPTS)
        self.guard: subprocess.Popen | None = None
        self.url = ""
        self.answered = False

    def start(self) -> str:
        self.lock.acquire()
        url = get_current_settings().server.database.connection_url
        if url is not None:  # under the lock: no other server is starting on this home
            seed_database(url.get_secret_value(), database_template())
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}/api"
        logger.info("Starting temporary server on %s", self.url.removesuffix("/api"))
        self.guard = _start_guarded(port)
        return self.url

    def ready(self) -> str:
        """The API URL, once the server answers there."""
        if self.answered:
            return self.url
        assert self.guard is not None, "start() first"
        try:
            for attempt in range(1, _START_ATTEMPTS + 1):
                if _wait_healthy(self.url, self.guard, self.timeout_s):
                    break
                self.guard.wait()
                if attempt == _START_ATTEMPTS:
                    raise RuntimeError(
                        f"the temporary Prefect server exited at start {_START_ATTEMPTS} times "
                        f"(last exit status {self.guard.returncode})"
                    )
                # Its port was taken between choosing it and binding it: the same URL cannot
                # change under the settings already given out, so take another and say so.
                port = _free_port()
                self.url = f"http://127.0.0.1:{port}/api"
                logger.info("Starting temporary server on %s", self.url.removesuffix("/api"))
                self.guard = _start_guarded(port)
        finally:
            self._release()
        self.answered = True
        return self.url

    def _release(self) -> None:
        if self.lock.is_locked:
            self.lock.release()

    def stop(self) -> None:
        self._release()
        if self.guard is not None and self.guard.poll() is None:
            logger.info("Stopping temporary server on %s", self.url.removesuffix("/api"))
            stop_server(self.guard)


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.local_server make-template | start | stop | status`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m flows.local_server",
        description="The Prefect server of `python -m flows.<name>` runs without "
        "PREFECT_API_URL. make-template: migrate the empty Prefect database that servers on a "
        "new home start from, and build MLflow's map of installed packages that rank 0 reads "
        "when it logs a model (scripts/setup.sh runs it once per environment). start: keep a "
        "server (and its UI) running on this PREFECT_HOME for the runs to use instead of "
        "starting their own; stop: stop it; status: where it runs (exit 3 if it does not).",
    )
    parser.add_argument("command", choices=["make-template", "start", "stop", "status"])
    parser.add_argument(
        "--port", type=int, help="start: the port (default: Prefect's 4200 if free, else any)"
    )
    parser.add_argument("--no-ui", action="store_true", help="start: without the UI")
    args = parser.parse_args(argv)
    home = Path(get_current_settings().home)
    if args.command == "make-template":
        print(f"Prefect database template: {make_database_template()}")
        from trainflow.tracking import package_map_file, warm_model_logging

        warm_model_logging()
        print(f"MLflow's map of installed packages: {package_map_file()}")
        return 0
    if args.command == "stop":
        stopped = stop_kept_server(home)
        print("stopped the kept server" if stopped else f"no server is kept on {home}")
        return 0
    if args.command == "status":
        url = kept_server_url(home)
        if url is None:
            print(f"no server is kept on {home}")
            return 3
        print(f"kept server: {url.removesuffix('/api')} (API {url}; log {home / KEPT_LOG})")
        return 0
    if get_current_settings().api.url:
        parser.error("PREFECT_API_URL is set: runs use that server, not one kept here")
    if args.port is not None and not 0 < args.port < 65536:
        parser.error(f"--port: {args.port} is not a port number")
    try:
        url = start_kept_server(home, args.port, ui=not args.no_ui)
    except ValueError as exc:
        parser.error(str(exc))
    where = url.removesuffix("/api")
    print(f"kept server: {where}{'' if args.no_ui else ' (UI)'}; API {url}; log {home / KEPT_LOG}")
    print("runs without PREFECT_API_URL use it; `python -m flows.local_server stop` stops it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
