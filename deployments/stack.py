"""A team's stack on one machine: PostgreSQL, a Prefect server and an MLflow server on it, an
object store for artifacts, datasets and checkpoints, and a process worker.

    python -m deployments.stack up        # start what is not running; print the addresses
    eval "$(python -m deployments.stack env)"   # point this shell's runs at it
    python -m flows.mlp                   # tracked and orchestrated by the stack's servers
    python -m deployments.stack status    # what runs where (exit 3 if something is down)
    python -m deployments.stack down      # stop what `up` started, by PID; the data stays
    python -m deployments.stack down --purge    # ... and delete the data

It lives in one folder, `~/.trainflow/stack` or `$TRAINFLOW_STACK_DIR`: the services' PIDs and
ports (`state.json`), their logs (`logs/`), the Prefect server's home and, for a user other than
root, the PostgreSQL cluster. Every server listens on 127.0.0.1 unless `up --host` says
otherwise; PostgreSQL always does. Credentials come from the environment:

- `TRAINFLOW_STACK_DB_PASSWORD`: the PostgreSQL password of the `trainflow` role (without it,
  one is made at the first `up` and kept in `secrets.json`, readable by its owner only);
- `TRAINFLOW_STACK_ARTIFACTS`: a real bucket for MLflow's artifacts (`s3://...`, `gs://...`)
  with that store's own credentials in the environment; without it, moto's S3 server runs as a
  stand-in object store, bucket `trainflow`;
- `PREFECT_SERVER_API_AUTH_STRING` (clients: `PREFECT_API_AUTH_STRING`) turns on the Prefect
  server's basic auth; `MLFLOW_AUTH_CONFIG_PATH` turns on MLflow's (`--app-name basic-auth`;
  clients: `MLFLOW_TRACKING_USERNAME`, `MLFLOW_TRACKING_PASSWORD`). See docs/team.md.
"""

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import shutil
import socket
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from deployments.stack_services import (
    BUCKET,
    POOL,
    Context,
    MlflowServer,
    ObjectStore,
    Postgres,
    PrefectServer,
    Record,
    StackError,
    Worker,
    stop_group,
)

REPO = Path(__file__).resolve().parents[1]
# Ports a first `up` takes when they are free (the tools' usual ones); else any free port.
# Later `up`s keep the ports the first one recorded, so the exported addresses stay valid.
PREFERRED_PORTS = {"postgres": 5433, "s3": 9000, "prefect": 4200, "mlflow": 5000}
SERVICES = ("postgres", "s3", "prefect", "mlflow", "worker")
STAND_IN_KEYS = {
    "AWS_ACCESS_KEY_ID": "trainflow-stack",
    "AWS_SECRET_ACCESS_KEY": "stand-in-not-a-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def stack_dir() -> Path:
    """`$TRAINFLOW_STACK_DIR`, else ~/.trainflow/stack."""
    return Path(os.environ.get("TRAINFLOW_STACK_DIR") or Path.home() / ".trainflow" / "stack")


def _free(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _any_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Stack:
    """The stack in one folder: its recorded state, and the verbs."""

    def __init__(self, root: Path):
        self.root = root
        self.state_file = root / "state.json"
        self.state: dict = {}
        if self.state_file.exists():
            self.state = json.loads(self.state_file.read_text())

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """One `up` or `down` at a time on this folder."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def save(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2))
        os.replace(tmp, self.state_file)

    def records(self) -> dict[str, Record]:
        return {k: Record(**v) for k, v in self.state.get("services", {}).items()}

    def db_password(self) -> str:
        given = os.environ.get("TRAINFLOW_STACK_DB_PASSWORD")
        if given:
            return given
        path = self.root / "secrets.json"
        if path.exists():
            return str(json.loads(path.read_text())["db_password"])
        password = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({"db_password": password}, out)
        return password

    def context(self, host: str | None = None) -> Context:
        host = host or self.state.get("host") or "127.0.0.1"
        self.state["host"] = host
        ports = self.state.setdefault("ports", {})
        for name, preferred in PREFERRED_PORTS.items():
            if name not in ports:
                bind = "127.0.0.1" if name == "postgres" else host
                ports[name] = preferred if _free(preferred, bind) else _any_port(bind)
        artifacts = os.environ.get("TRAINFLOW_STACK_ARTIFACTS")
        ctx = Context(
            root=self.root,
            host=host,
            ports=ports,
            db_password=self.db_password(),
            s3_endpoint=None,
            artifacts=artifacts or f"s3://{BUCKET}/mlflow",
        )
        if not artifacts:
            ctx.s3_endpoint = ctx.url("s3")
            ctx.s3_env = dict(STAND_IN_KEYS)
        return ctx

    def wanted(self) -> tuple[str, ...]:
        stand_in = not os.environ.get("TRAINFLOW_STACK_ARTIFACTS")
        return tuple(s for s in SERVICES if s != "s3" or stand_in)

    def client_env(self, ctx: Context) -> dict[str, str]:
        """What a run needs in its environment to use the stack."""
        env = {
            "PREFECT_API_URL": ctx.url("prefect") + "/api",
            "MLFLOW_TRACKING_URI": ctx.url("mlflow"),
            # Large artifacts go up in parts through the server (MLflow's default is one PUT,
            # which fails for models of about a gigabyte behind proxies).
            "MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD": "true",
        }
        if ctx.s3_endpoint:
            env.update(
                S3_ENDPOINT_URL=ctx.s3_endpoint, AWS_ENDPOINT_URL=ctx.s3_endpoint, **ctx.s3_env
            )
            # Prepared datasets are published to the shared bucket and streamed from there;
            # runs keep their checkpoints there too, so any machine can resume them.
            env["TRAINFLOW_DATASETS"] = f"s3://{BUCKET}/datasets"
            env["TRAINFLOW_OUTPUT_ROOT"] = f"s3://{BUCKET}/runs"
        return env

    def service(self, name: str, ctx: Context):
        if name == "postgres":
            return Postgres(ctx)
        if name == "s3":
            return ObjectStore(ctx)
        if name == "prefect":
            return PrefectServer(ctx)
        if name == "mlflow":
            return MlflowServer(ctx)
        return Worker(ctx, self.client_env(ctx), REPO)

    def up(self, host: str | None) -> None:
        with self.locked():
            if host and self.state.get("host") not in (None, host):
                running = [n for n, r in self.records().items() if r.process()]
                if running:
                    raise StackError(
                        f"the stack runs on {self.state['host']}: `down` first to move it to {host}"
                    )
            ctx = self.context(host)
            self.save()
            records = self.records()
            started: list[str] = []
            try:
                for name in self.wanted():
                    if name in records and records[name].process():
                        continue
                    if name == "postgres" and (found := Postgres(ctx).pid()) is not None:
                        # Running, though not recorded (a `down` interrupted before its stop).
                        self.state.setdefault("services", {})[name] = asdict(found)
                        continue
                    print(f"starting {name} ...", file=sys.stderr, flush=True)
                    record = self.service(name, ctx).start()
                    self.state.setdefault("services", {})[name] = asdict(record)
                    self.save()
                    started.append(name)
            except BaseException:
                for name in reversed(started):
                    self._stop(name, ctx)
                raise

    def _stop(self, name: str, ctx: Context) -> bool:
        record = self.records().get(name)
        if record is None:
            return False
        stopped = Postgres(ctx).stop(record) if name == "postgres" else stop_group(record, name)
        self.state.get("services", {}).pop(name, None)
        self.save()
        return stopped

    def down(self, purge: bool) -> None:
        if not self.state.get("ports"):
            print(f"no stack in {self.root}", file=sys.stderr)
            return
        with self.locked():
            ctx = self.context()
            for name in reversed(SERVICES):
                if self._stop(name, ctx):
                    print(f"stopped {name}", file=sys.stderr)
            if purge:
                with contextlib.suppress(StackError):
                    Postgres(ctx).purge()
                shutil.rmtree(self.root, ignore_errors=True)
                print(f"deleted {self.root} and its data", file=sys.stderr)

    def report(self) -> bool:
        """Print what runs where and the client settings; True if everything wanted runs."""
        if not self.state.get("ports"):
            print(f"no stack in {self.root} (python -m deployments.stack up)")
            return False
        ctx = self.context()
        records = self.records()
        print(f"trainflow stack in {self.root}")
        notes = {
            "postgres": f"127.0.0.1:{ctx.ports['postgres']} (databases prefect, mlflow)",
            "s3": f"{ctx.url('s3')} (moto's S3 server: a stand-in; objects kept in memory)",
            "prefect": f"UI {ctx.url('prefect')}",
            "mlflow": f"UI {ctx.url('mlflow')} (artifacts {ctx.artifacts})",
            "worker": f"work pool {POOL}",
        }
        everything = True
        for name in self.wanted():
            record = records.get(name)
            alive = record is not None and record.process() is not None
            everything &= alive
            state = f"running  pid {record.pid:<7}" if alive and record else "stopped" + " " * 11
            print(f"  {name:<9}{state} {notes[name]}")
        print()
        print(self.exports(ctx))
        return everything

    def exports(self, ctx: Context) -> str:
        return "\n".join(f"export {k}={v}" for k, v in self.client_env(ctx).items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.stack",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    up = verbs.add_parser("up", help="start what is not running and print the addresses")
    up.add_argument(
        "--host",
        default=None,
        help="address the servers listen on (default 127.0.0.1; 0.0.0.0 for a team's network)",
    )
    down = verbs.add_parser("down", help="stop what `up` started; the data stays")
    down.add_argument("--purge", action="store_true", help="also delete the stack's data")
    verbs.add_parser("status", help="what runs where; exit 3 if something wanted is down")
    verbs.add_parser("env", help="only the export lines, for `eval`")
    args = parser.parse_args(argv)
    stack = Stack(stack_dir())
    try:
        if args.verb == "up":
            stack.up(args.host)
            return 0 if stack.report() else 3
        if args.verb == "down":
            stack.down(args.purge)
            return 0
        if args.verb == "status":
            return 0 if stack.report() else 3
        if not stack.state.get("ports"):
            raise StackError(f"no stack in {stack.root} (python -m deployments.stack up)")
        print(stack.exports(stack.context()))
        return 0
    except StackError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: what this `up` started was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
