"""The services of a team's stack, each started, checked and stopped by its own PID.

- `Postgres`: Debian's PostgreSQL as a private cluster (`initdb`, `pg_ctl`) holding two
  databases, `prefect` and `mlflow`. PostgreSQL refuses to run as root, so a root user's cluster
  runs as the package's `postgres` system user, with its data under
  `/var/lib/postgresql/trainflow/<id>` (the stack folder, under root's home, is not reachable
  for that user); anyone else's lives in the stack folder.
- `ObjectStore`: moto's S3 server, a stand-in for a real object store (it keeps its objects in
  memory: they are gone when it stops). With `TRAINFLOW_STACK_ARTIFACTS` set to a real bucket
  none is started.
- `PrefectServer`, `MlflowServer` (artifacts proxied to the object store), `Worker` (a process
  work pool's worker).

Every server listens on the stack's host (127.0.0.1 unless told otherwise); PostgreSQL only ever
on 127.0.0.1. Passwords reach the servers through their environment, never a command line
(which any local user can read in `ps`).
"""

import contextlib
import hashlib
import os
import pwd
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from trainflow.launch.processes import stop_process_group

START_TIMEOUT_S = 180.0
STOP_WAIT_S = 20.0
DB_USER = "trainflow"
DATABASES = ("prefect", "mlflow")
BUCKET = "trainflow"
POOL = "cpu-local"


class StackError(Exception):
    """A stack command cannot go on; the message says why and what to do."""


@dataclass
class Record:
    """What `up` wrote down about one running service, so `down` stops that process only."""

    pid: int
    create_time: float
    port: int

    def process(self) -> psutil.Process | None:
        """The recorded process if it still runs (a reused PID is not it)."""
        try:
            proc = psutil.Process(self.pid)
            same = abs(proc.create_time() - self.create_time) < 0.05
            if same and proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                return proc
        except psutil.Error:
            pass
        return None


@dataclass
class Context:
    """What every service needs: the folder, the host, the ports and the secrets."""

    root: Path
    host: str
    ports: dict[str, int]
    db_password: str
    s3_endpoint: str | None
    artifacts: str
    s3_env: dict[str, str] = field(default_factory=dict)

    def log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def url(self, name: str) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.ports[name]}"

    def base_env(self) -> dict[str, str]:
        """The environment of a server: this one's, less what would point it elsewhere."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PREFECT_", "MLFLOW_")) and k != "PGPASSWORD"
        }
        return {**env, **self.s3_env}


def wait_for_http(url: str, record: "Record", what: str, log: Path) -> None:
    """Wait until `url` answers 200; raise naming the log if the process ends or time runs
    out."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if record.process() is None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise StackError(f"{what} did not start (log: {log}):\n{tail}")
        time.sleep(0.3)


def spawn(command: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> Record:
    """Start `command` in a session of its own (it outlives `up`), output to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Record(proc.pid, psutil.Process(proc.pid).create_time(), 0)


def stop_group(record: Record, what: str) -> bool:
    """SIGTERM the recorded process's group and wait until all of it is gone; SIGKILL what is
    left after STOP_WAIT_S. False if the process was not running."""
    if record.process() is None:
        return False
    if not stop_process_group(record.pid, STOP_WAIT_S):
        print(f"{what} did not stop in {STOP_WAIT_S:.0f} s: killed it", file=sys.stderr)
    return True


@contextlib.contextmanager
def stopped_on_failure(record: Record, what: str) -> Iterator[None]:
    """Stop the process just started if what follows its start fails (or is interrupted)."""
    try:
        yield
    except BaseException:
        stop_group(record, what)
        raise


# -- PostgreSQL ------------------------------------------------------------------------------


def postgres_bin() -> Path:
    """The folder of Debian's PostgreSQL server programs (the newest installed)."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
        key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0,
    )
    if found:
        return found[-1].parent
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).parent
    raise StackError(
        "PostgreSQL is not installed: `bash scripts/setup.sh --with-stack` installs Debian's "
        "postgresql package (needs root and apt-get), or install it yourself"
    )


def cluster_home(root: Path) -> Path:
    """Where the PostgreSQL cluster of the stack in `root` lives (its data, its server log):
    in the stack's folder, or for root (whose home the `postgres` user cannot reach) under
    /var/lib/postgresql/trainflow/<id of the folder>."""
    if os.geteuid() != 0:
        return root / "postgres"
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    return Path("/var/lib/postgresql/trainflow") / digest


class Postgres:
    """A private PostgreSQL cluster with the stack's two databases."""

    name = "postgres"

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.bin = postgres_bin()
        if os.geteuid() == 0:
            try:
                self.owner: pwd.struct_passwd | None = pwd.getpwnam("postgres")
            except KeyError:
                raise StackError(
                    "PostgreSQL refuses to run as root and there is no `postgres` user: "
                    "install Debian's postgresql package or run the stack as another user"
                ) from None
        else:
            self.owner = None
        self.home = cluster_home(ctx.root)
        self.data = self.home / "data"
        self.log = self.home / "server.log"

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", "postgres", "--"] if self.owner else []
        return subprocess.run(
            [*prefix, *args], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}
        )

    def _own(self, path: Path) -> None:
        if self.owner:
            os.chown(path, self.owner.pw_uid, self.owner.pw_gid)

    def initialized(self) -> bool:
        return (self.data / "PG_VERSION").exists()

    def init(self) -> None:
        """Create the cluster: scram-sha-256 logins only, on 127.0.0.1 and the stack's port."""
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._own(self.home)
        pwfile = self.home / ".pwfile"
        pwfile.write_text(self.ctx.db_password + "\n")
        pwfile.chmod(0o600)
        self._own(pwfile)
        try:
            done = self._run(
                str(self.bin / "initdb"),
                *("-D", str(self.data), "-U", DB_USER, "--pwfile", str(pwfile)),
                *("--auth", "scram-sha-256", "--encoding", "UTF8", "--no-instructions"),
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if done.returncode != 0:
            raise StackError(f"initdb failed:\n{done.stdout}{done.stderr}")
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                "\n# trainflow stack\nlisten_addresses = '127.0.0.1'\n"
                f"port = {self.ctx.ports['postgres']}\nunix_socket_directories = ''\n"
                "max_connections = 200\n"
            )

    def pid(self) -> Record | None:
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
            return Record(pid, psutil.Process(pid).create_time(), self.ctx.ports["postgres"])
        except (OSError, ValueError, IndexError, psutil.Error):
            return None

    def start(self) -> Record:
        if not self.initialized():
            self.init()
        done = self._run(
            str(self.bin / "pg_ctl"),
            *("-D", str(self.data), "-l", str(self.log), "-w", "-t", "90", "start"),
        )
        record = self.pid()
        if done.returncode != 0 or record is None:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise StackError(f"PostgreSQL did not start:\n{done.stdout}{done.stderr}{tail}")
        try:
            self.create_databases()
        except BaseException:
            self.stop(record)
            raise
        return record

    def connect(self, database: str = "postgres"):
        import psycopg

        return psycopg.connect(
            host="127.0.0.1",
            port=self.ctx.ports["postgres"],
            user=DB_USER,
            password=self.ctx.db_password,
            dbname=database,
            connect_timeout=10,
            autocommit=True,
        )

    def create_databases(self) -> None:
        import psycopg

        try:
            conn = self.connect()
        except psycopg.OperationalError as err:
            raise StackError(
                f"cannot log in to the stack's PostgreSQL as {DB_USER}: {err}".strip()
                + "\n(TRAINFLOW_STACK_DB_PASSWORD must be the password the cluster was made with)"
            ) from None
        try:
            with conn.cursor() as cur:
                for name in DATABASES:
                    cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                    if cur.fetchone() is None:
                        cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()

    def stop(self, record: Record) -> bool:
        if record.process() is None:
            return False
        done = self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        if done.returncode != 0:
            return stop_group(record, "PostgreSQL")
        return True

    def purge(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)


# -- The servers -----------------------------------------------------------------------------


class ObjectStore:
    """moto's S3 server: the stand-in object store, with the stack's bucket."""

    name = "s3"

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def start(self) -> Record:
        port = self.ctx.ports[self.name]
        log = self.ctx.log(self.name)
        command = [sys.executable, "-m", "moto.server", "-H", self.ctx.host, "-p", str(port)]
        record = spawn(command, self.ctx.base_env(), log)
        record.port = port
        with stopped_on_failure(record, "the S3 stand-in"):
            wait_for_http(self.ctx.url(self.name) + "/moto-api/", record, "the S3 stand-in", log)
            import boto3

            client = boto3.client("s3", endpoint_url=self.ctx.url(self.name), **_keys(self.ctx))
            names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
            if BUCKET not in names:
                client.create_bucket(Bucket=BUCKET)
        return record


def _keys(ctx: Context) -> dict[str, str]:
    return {
        "aws_access_key_id": ctx.s3_env.get("AWS_ACCESS_KEY_ID", ""),
        "aws_secret_access_key": ctx.s3_env.get("AWS_SECRET_ACCESS_KEY", ""),
        "region_name": ctx.s3_env.get("AWS_DEFAULT_REGION", "us-east-1"),
    }


class PrefectServer:
    """`prefect server start` on the stack's PostgreSQL, with its UI and services."""

    name = "prefect"

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def env(self) -> dict[str, str]:
        pg = self.ctx.ports["postgres"]
        return {
            **self.ctx.base_env(),
            "PREFECT_HOME": str(self.ctx.root / "prefect"),
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": (
                f"postgresql+asyncpg://{DB_USER}:{self.ctx.db_password}@127.0.0.1:{pg}/prefect"
            ),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
            **_passed("PREFECT_SERVER_API_AUTH_STRING", "PREFECT_SERVER_DATABASE_"),
        }

    def start(self) -> Record:
        port = self.ctx.ports[self.name]
        log = self.ctx.log(self.name)
        command = [
            *(sys.executable, "-m", "prefect", "server", "start"),
            *("--host", self.ctx.host, "--port", str(port)),
        ]
        record = spawn(command, self.env(), log)
        record.port = port
        with stopped_on_failure(record, "the Prefect server"):
            wait_for_http(
                self.ctx.url(self.name) + "/api/health", record, "the Prefect server", log
            )
            # A flow run whose process died without a word ends Crashed, not Running for good.
            env = {**self.ctx.base_env(), "PREFECT_API_URL": self.ctx.url(self.name) + "/api"}
            env.update(_passed("PREFECT_API_AUTH_STRING"))
            done = subprocess.run(
                [sys.executable, "-m", "deployments.automations"],
                env=env,
                capture_output=True,
                text=True,
                cwd=Path(__file__).resolve().parents[1],
            )
            if done.returncode != 0:
                raise StackError(f"cannot create the automations:\n{done.stdout}{done.stderr}")
        return record


class MlflowServer:
    """`mlflow server` on the stack's PostgreSQL, proxying artifacts to the object store."""

    name = "mlflow"

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def start(self) -> Record:
        port = self.ctx.ports[self.name]
        log = self.ctx.log(self.name)
        pg = self.ctx.ports["postgres"]
        command = [
            *(sys.executable, "-m", "mlflow", "server", "--host", self.ctx.host),
            *("--port", str(port), "--workers", "2"),
            *("--backend-store-uri", f"postgresql://{DB_USER}@127.0.0.1:{pg}/mlflow"),
            *("--artifacts-destination", self.ctx.artifacts, "--serve-artifacts"),
        ]
        env = {
            **self.ctx.base_env(),
            # libpq reads the password from here: none on the command line.
            "PGPASSWORD": self.ctx.db_password,
            # Runs GenAI jobs the pipelines never use, and leaves its queue in /dev/shm.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            **_passed("MLFLOW_AUTH_CONFIG_PATH", "MLFLOW_FLASK_SERVER_SECRET_KEY"),
        }
        if self.ctx.s3_endpoint:
            env["MLFLOW_S3_ENDPOINT_URL"] = self.ctx.s3_endpoint
        if os.environ.get("MLFLOW_AUTH_CONFIG_PATH"):
            command += ["--app-name", "basic-auth"]
        record = spawn(command, env, log)
        record.port = port
        with stopped_on_failure(record, "the MLflow server"):
            wait_for_http(self.ctx.url(self.name) + "/health", record, "the MLflow server", log)
        return record


class Worker:
    """A Prefect worker of the process work pool `cpu-local` (prefect.yaml's CPU pool)."""

    name = "worker"

    def __init__(self, ctx: Context, client_env: dict[str, str], repo: Path):
        self.ctx, self.client_env, self.repo = ctx, client_env, repo

    def start(self) -> Record:
        env = {**self.ctx.base_env(), **self.client_env}
        env["PREFECT_HOME"] = str(self.ctx.root / "worker")
        # Prefect's process worker writes each flow run's workspace manifest (its whole
        # environment) to a temp folder, left behind when the worker is stopped mid-run: in the
        # stack's folder, not /tmp. The flow runs' own temp files go there too.
        tmp = self.ctx.root / "worker" / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(tmp)
        created = subprocess.run(
            [sys.executable, "-m", "prefect", "work-pool", "create", POOL, "--type", "process"],
            env=env,
            capture_output=True,
            text=True,
            cwd=self.repo,
        )
        if created.returncode != 0 and "already exists" not in created.stdout + created.stderr:
            raise StackError(
                f"cannot create the work pool {POOL}:\n{created.stdout}{created.stderr}"
            )
        command = [
            *(sys.executable, "-m", "prefect", "worker", "start"),
            *("--pool", POOL, "--type", "process", "--name", f"stack-{os.uname().nodename}"),
        ]
        record = spawn(command, env, self.ctx.log(self.name), cwd=self.repo)
        time.sleep(2.0)
        if record.process() is None:
            tail = self.ctx.log(self.name).read_text(errors="replace")[-2000:]
            raise StackError(f"the Prefect worker did not start:\n{tail}")
        return record


def _passed(*prefixes: str) -> dict[str, str]:
    """Settings a user gave in the environment that a server should also get."""
    return {k: v for k, v in os.environ.items() if k.startswith(prefixes)}
