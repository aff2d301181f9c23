"""MLflow tracking: one parent run per pipeline run, metrics from rank 0 only, registration.

The orchestrating process creates the store and the run before any rank starts (a fresh SQLite
store created by several ranks at once races); ranks receive only the run id and log through a
buffered sink, so a training step never waits on a tracking-server round trip.
"""

import atexit
import contextlib
import json
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainflow.compat import mlflow as mlflow_compat
from trainflow.paths import safe_name

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
MAX_METRICS_PER_BATCH = 1000  # the most one `log_batch` call takes


def tracking_uri() -> str:
    """`$MLFLOW_TRACKING_URI`, else a SQLite store `mlflow.db` in the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def _artifact_location(experiment: str) -> str | None:
    """For a SQLite store, keep artifacts beside the database, not in the working directory."""
    db = _sqlite_path(tracking_uri())
    if db is None:
        return None  # a tracking server decides
    return (db.parent / "mlartifacts" / safe_name(experiment, "experiment")).as_uri()


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` store, else None (a server manages its own)."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///")).expanduser().resolve()


@contextlib.contextmanager
def store_lock() -> Iterator[None]:
    """Hold the MLflow store's inter-process lock (a no-op for a tracking server).

    SQLite stores are created and migrated by whichever process opens them first, and two
    pipelines started together on a fresh store race there; so do two that create the same
    experiment. Both happen under this lock (a file beside the database).
    """
    db = _sqlite_path(tracking_uri())
    if db is None:
        yield
        return
    from filelock import FileLock

    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{db}.lock", timeout=600):
        yield


_READY: set[str] = set()


def store_client() -> Any:
    """A client of the configured store; the first one per process creates the store (locked)."""
    from mlflow.tracking import MlflowClient

    uri = tracking_uri()
    if uri in _READY:
        return MlflowClient(tracking_uri=uri)
    with store_lock():
        # Opening the tracking and registry stores creates or migrates the schema.
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)
        client.search_registered_models(max_results=1)
    _READY.add(uri)
    return client


def open_store_ahead() -> None:
    """Open the configured store now if it is a SQLite file that exists: what the run's first
    MLflow call would do (MLflow checks the schema against its migrations, a few tenths of a
    second of a core), for a pipeline's process to do while it waits for its checks. A store
    not made yet is left to the run, as is any error (the run meets it, and says so)."""
    db = _sqlite_path(tracking_uri())
    if db is None or not db.is_file():
        return
    with contextlib.suppress(Exception):
        store_client()


class MetricsSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def flush(self) -> None: ...


class NullSink:
    """What ranks other than 0 get: the loop never asks whether logging is on."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def flush(self) -> None:
        pass


class MlflowSink:
    """Sends metrics to an existing MLflow run from a writer thread.

    `log` only queues a step's metrics; the thread stores everything queued since its last
    write in one `log_batch`, so a training step seldom waits on the tracking store. It writes
    at once after a quiet spell, then at most every `interval_s` seconds: short steps logged
    often cost one store transaction per interval, not one per `log` (each takes a few ms of
    a core that the training shares). `flush` writes at once, waits until everything logged
    so far is stored and raises what storing it raised; `log` flushes by itself when
    `flush_every` calls are waiting, so the backlog stays bounded.

    MLflow's own asynchronous logging (`synchronous=False`) queues the same way, but ending a
    run once it was used waits for its thread's next queue poll, up to a second: once in rank
    0 after training and once in the pipeline's process, on every run.
    """

    def __init__(self, run_id: str, flush_every: int = 100, interval_s: float = 5.0):
        from mlflow.entities import Metric

        self._metric = Metric
        self.run_id = run_id
        self.client = store_client()
        self.flush_every = flush_every
        self.interval_s = interval_s
        self._queue: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
        self._hurry = threading.Event()  # a flush is waiting: write now
        self._last_write = float("-inf")
        self._stored = threading.Condition()
        self._logged = self._written = 0
        self._error: Exception | None = None
        self._writer: threading.Thread | None = None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        self._queue.put([self._metric(k, float(v), now, step) for k, v in metrics.items()])
        with self._stored:
            self._logged += 1
            waiting = self._logged - self._written
        if self._writer is None:
            self._writer = threading.Thread(target=self._write, name="mlflow-sink", daemon=True)
            self._writer.start()
            atexit.register(self._flush_at_exit)
        if waiting >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        self._hurry.set()
        with self._stored:
            self._stored.wait_for(lambda: self._written >= self._logged)
            self._hurry.clear()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _flush_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.flush()

    def _write(self) -> None:
        while True:
            batches = [self._queue.get()]
            self._hurry.wait(self._last_write + self.interval_s - time.monotonic())
            with contextlib.suppress(queue.Empty):
                while True:
                    batches.append(self._queue.get_nowait())
            metrics = [metric for batch in batches for metric in batch]
            error = None
            try:
                for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
                    chunk = metrics[start : start + MAX_METRICS_PER_BATCH]
                    self.client.log_batch(self.run_id, metrics=chunk)
            except Exception as exc:  # raised to the caller by its next flush
                error = exc
            self._last_write = time.monotonic()
            with self._stored:
                self._written += len(batches)
                self._error = self._error or error
                self._stored.notify_all()


def warm_model_logging() -> None:
    """Build now what MLflow builds the first time a process logs a model with stated
    requirements: a map of every installed distribution to the modules it provides (MLflow
    checks the requirements against it), 1 to 2.5 s with this project's environment on 2
    cores. A launch's standby agent runs it while it waits for its launch (`RANK_WARMUPS`), so
    that rank 0, forked from it, logs its model without building the map again.

    The map depends only on what is installed: it is kept on disk (`package_map_file`) and
    read back by later runs in the same environment; the install builds it, so a first run
    reads it too. It is internal to MLflow (`compat.mlflow`): if it is not there, nothing is
    done."""
    if not mlflow_compat.package_map_unbuilt():
        return  # built already, or another MLflow: it builds the map itself when it logs
    kept = package_map_file()
    with contextlib.suppress(OSError, ValueError):
        mlflow_compat.set_package_map(json.loads(kept.read_text()))
        return
    try:
        built = mlflow_compat.build_package_map()
    except Exception:
        return
    with contextlib.suppress(OSError):
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_name(f"{kept.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(built))
        os.replace(partial, kept)


def package_map_file() -> Path:
    """Where MLflow's map of installed packages to modules is kept for this environment
    (`package_map_folder`): the name changes with the interpreter and with anything
    installed, upgraded or removed (the names of the distributions' metadata folders carry
    their versions, on every `sys.path` entry, the working directory as an absolute path)."""
    import hashlib

    digest = hashlib.sha256(sys.prefix.encode())
    for entry in sys.path:
        folder = os.path.abspath(entry or ".")
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(folder)):
                if name.endswith((".dist-info", ".egg-info", ".egg-link", ".pth")):
                    digest.update(f"{folder}/{name}".encode())
    return package_map_folder() / f"mlflow-package-map-{digest.hexdigest()[:16]}.json"


def package_map_folder() -> Path:
    """The environment's own folder (`<sys.prefix>/share/trainflow`, where the install builds
    the map: `python -m flows.local_server make-template`) where it can be written, else the
    cache under `trainflow_home()`."""
    from trainflow.paths import trainflow_home

    shared = Path(sys.prefix) / "share" / "trainflow"
    nearest = next(p for p in (shared, *shared.parents) if p.exists())
    if os.access(nearest, os.W_OK):
        return shared
    return trainflow_home() / "cache"


PROGRESS_FILE = "progress.json"
# What rank 0 imports once it logs its first metrics (`metrics_sink`): workloads list it in
# their `RANK_IMPORTS`, so that a launch's standby agent imports it ahead of the ranks.
SINK_IMPORTS = ("mlflow.store.tracking.sqlalchemy_store",)


class ProgressFile:
    """Rank 0's training progress as a small JSON file the orchestrator follows.

    Ranks never talk to Prefect: the pipeline reads this file and shows a progress artifact.
    Writes are atomic (write, then rename), so a reader never sees half a file.
    """

    def __init__(self, path: str | Path | None, max_steps: int):
        self.path = Path(path) if path is not None else None
        self.max_steps = max_steps

    def update(self, step: int) -> None:
        """Record that `step` of `max_steps` is done (a no-op without a path)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "max_steps": self.max_steps}))
        tmp.replace(self.path)


def read_progress(path: str | Path) -> float | None:
    """Percent of steps done from a progress file, or None when there is none yet."""
    try:
        state = json.loads(Path(path).read_text())
        return 100.0 * state["step"] / state["max_steps"]
    except (OSError, ValueError, KeyError, ZeroDivisionError):
        return None


def metrics_sink(run_id: str | None, is_rank_zero: bool) -> MetricsSink:
    """An MLflow sink on rank 0 when a run id is given, a null sink everywhere else."""
    if run_id and is_rank_zero:
        return MlflowSink(run_id)
    return NullSink()


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = str(value)[:6000]


def flatten_params(config: Mapping[str, Any]) -> dict[str, str]:
    """`{"a": {"b": 1}}` -> `{"a.b": "1"}`, the form MLflow params take."""
    out: dict[str, str] = {}
    _flatten("", config, out)
    return out


OWNER_HOST_TAG = "trainflow.host"
OWNER_PID_TAG = "trainflow.pid"
OWNER_START_TAG = "trainflow.pid_start"
FAILURE_REASON_TAG = "trainflow.failure_reason"
RESUMED_TAG = "trainflow.resumed"
# MLflow's own tag for a nested run: its UI shows the run under this parent.
PARENT_RUN_TAG = "mlflow.parentRunId"

# Exceptions that mean "stopped from outside", matched by class name so this module needs
# neither Prefect (`TerminationSignal`: SIGTERM under a flow run) nor the callers' own types
# (`Preempted`; `Terminated`: SIGTERM outside a flow run, raised by the command line).
_STOP_NAMES = frozenset({"TerminationSignal", "Preempted", "Terminated", "StopRequested"})

_last_run_id: str | None = None


def last_run_id() -> str | None:
    """The top-level MLflow run `pipeline_run` last opened (or resumed) in this process, if
    any: never a nested one (a sweep's trial)."""
    return _last_run_id


def is_stop(exc: BaseException) -> bool:
    """Whether `exc` means the run was stopped (KILLED) rather than failed.

    Ctrl-C, SIGTERM (Prefect raises `TerminationSignal`), a preempted node, exiting, and
    Prefect's cancellation types (names with Cancel or Abort) are stops.
    """
    if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return True
    # Ranks preempted on their own (a node taken away) fail the launch with a rank error that
    # names the rank's exception type.
    if str(getattr(exc, "exc_type", "")).endswith(".Preempted"):
        return True
    names = [cls.__name__ for cls in type(exc).__mro__]
    return any(n in _STOP_NAMES or "Cancel" in n or "Abort" in n for n in names)


def owner_tags() -> dict[str, str]:
    """Tags naming this process (host, pid, start time), so a later pipeline can tell whether
    a RUNNING run still has a process behind it; the start time tells a reused pid apart."""
    import psutil

    return {
        OWNER_HOST_TAG: socket.gethostname(),
        OWNER_PID_TAG: str(os.getpid()),
        OWNER_START_TAG: repr(psutil.Process().create_time()),
    }


def _owner_alive(pid: int, started: float) -> bool:
    """Whether process `pid` of this host exists and is the one that started at `started`."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return abs(proc.create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # cannot look: do not judge


def _dead_owner(tags: Mapping[str, str]) -> int | None:
    """The pid of the run's owner when it is a process of this host that has exited, else None
    (alive, another host's, or a run without owner tags)."""
    if tags.get(OWNER_HOST_TAG) != socket.gethostname():
        return None
    try:
        pid, started = int(tags[OWNER_PID_TAG]), float(tags[OWNER_START_TAG])
    except (KeyError, ValueError):
        return None
    return None if _owner_alive(pid, started) else pid


def reap_orphaned_runs(client: Any, experiment_id: str | None = None) -> list[str]:
    """Mark FAILED the RUNNING runs whose process on this host has exited: of the experiment
    `experiment_id`, or of every active experiment in the store (None).

    A process killed outright (SIGKILL, out of memory) cannot end its run, which would show
    RUNNING forever. Runs owned by other hosts are left alone: their processes cannot be seen
    from here. Each reaped run gets a `trainflow.failure_reason` tag naming the dead pid and
    this host. Returns their ids.
    """
    host = socket.gethostname()
    query = f"attributes.status = 'RUNNING' and tags.`{OWNER_HOST_TAG}` = '{host}'"
    experiments = [experiment_id] if experiment_id is not None else _experiment_ids(client)
    reaped: list[str] = []
    # A search takes a bounded number of experiments at once.
    for first in range(0, len(experiments), 100):
        token = None
        while True:
            page = client.search_runs(
                experiments[first : first + 100],
                filter_string=query,
                max_results=1000,
                page_token=token,
            )
            for run in page:
                pid = _dead_owner(run.data.tags)
                if pid is None:
                    continue
                reason = (
                    f"the process that ran it (pid {pid} on {host}) exited without ending the "
                    "run (killed or crashed)"
                )
                client.set_tag(run.info.run_id, FAILURE_REASON_TAG, reason)
                client.set_terminated(run.info.run_id, status="FAILED")
                reaped.append(run.info.run_id)
            token = page.token
            if not token:
                break
    return reaped


def _experiment_ids(client: Any) -> list[str]:
    """The ids of every active experiment in the store."""
    ids: list[str] = []
    token = None
    while True:
        page = client.search_experiments(max_results=1000, page_token=token)
        ids.extend(str(e.experiment_id) for e in page)
        token = page.token
        if not token:
            return ids


def reap_dead_runs() -> list[str]:
    """`reap_orphaned_runs` over the whole configured store, under its lock; nothing (and no
    store created) where the store is a SQLite file that does not exist yet. Every command
    that opens the store calls it: a run whose pipeline was SIGKILLed shows FAILED, with its
    reason, the next time anything looks."""
    db = _sqlite_path(tracking_uri())
    if db is not None and not db.is_file():
        return []
    client = store_client()
    with store_lock():
        return reap_orphaned_runs(client)


@dataclass(frozen=True)
class RunRow:
    """One run as `python -m trainflow runs` lists it."""

    run_id: str
    experiment: str
    status: str
    start_time: int  # ms since the epoch
    name: str
    reason: str | None  # why trainflow marked it FAILED, if it did


def list_runs(experiment: str | None, status: str | None, limit: int) -> list[RunRow] | None:
    """The newest `limit` runs of `experiment` (None: every active one), of `status` if given;
    None when there is no such experiment. Empty when the store does not exist yet."""
    db = _sqlite_path(tracking_uri())
    if db is not None and not db.is_file():
        return [] if experiment is None else None
    client = store_client()
    names = {str(e.experiment_id): e.name for e in client.search_experiments(max_results=1000)}
    if experiment is not None:
        ids = [i for i, name in names.items() if name == experiment]
        if not ids:
            return None
    else:
        ids = list(names)
    if not ids:
        return []
    found = client.search_runs(
        ids,
        filter_string=f"attributes.status = '{status}'" if status else "",
        order_by=["attributes.start_time DESC"],
        max_results=limit,
    )
    return [
        RunRow(
            run_id=run.info.run_id,
            experiment=names.get(str(run.info.experiment_id), str(run.info.experiment_id)),
            status=str(run.info.status),
            start_time=int(run.info.start_time or 0),
            name=run.info.run_name or "",
            reason=run.data.tags.get(FAILURE_REASON_TAG),
        )
        for run in found
    ]


def _experiment_id(client: Any, experiment: str) -> str:
    found = client.get_experiment_by_name(experiment)
    if found:
        return str(found.experiment_id)
    return str(
        client.create_experiment(experiment, artifact_location=_artifact_location(experiment))
    )


def check_resumable(run_id: str, experiment: str | None = None) -> None:
    """Refuse, without changing anything, to continue a run `pipeline_run` would not continue:
    none such in the store, deleted, in another experiment than `experiment` (when given),
    FINISHED, or RUNNING in a live process of this host. Opens no store that does not exist.

    Raises:
        ValueError: naming the run and why it cannot be continued.
    """
    from mlflow.exceptions import MlflowException

    db = _sqlite_path(tracking_uri())
    if db is not None and not db.is_file():
        raise ValueError(f"cannot resume MLflow run {run_id}: no such run in {tracking_uri()}")
    reap_dead_runs()
    client = store_client()
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise ValueError(
            f"cannot resume MLflow run {run_id}: no such run in {tracking_uri()}"
        ) from None
    _refuse_resume(client, run, experiment)


def _refuse_resume(client: Any, run: Any, experiment: str | None) -> None:
    """Raise ValueError if `run` cannot be continued (in `experiment`, when given)."""
    run_id = run.info.run_id
    if run.info.lifecycle_stage == "deleted":
        raise ValueError(f"cannot resume MLflow run {run_id}: it was deleted")
    if experiment is not None:
        where = client.get_experiment(run.info.experiment_id).name
        if where != experiment:
            raise ValueError(
                f"cannot resume MLflow run {run_id} in experiment {experiment!r}: "
                f"it is in {where!r}"
            )
    if run.info.status == "FINISHED":
        raise ValueError(f"MLflow run {run_id} already finished; nothing to resume")
    tags = run.data.tags
    if run.info.status == "RUNNING" and tags.get(OWNER_HOST_TAG) == socket.gethostname():
        pid = int(tags.get(OWNER_PID_TAG, "0") or 0)
        if pid and _dead_owner(tags) is None:
            raise ValueError(
                f"cannot resume MLflow run {run_id}: it is still running "
                f"(pid {pid} on {tags[OWNER_HOST_TAG]})"
            )


def _resume(client: Any, experiment: str, run_id: str) -> None:
    """Set an unfinished run of `experiment` back to RUNNING, owned by this process."""
    from mlflow.entities import RunTag
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise ValueError(
            f"cannot resume MLflow run {run_id}: no such run in {tracking_uri()}"
        ) from None
    _refuse_resume(client, run, experiment)
    tags = run.data.tags
    resumed = int(tags.get(RESUMED_TAG, "0") or 0) + 1
    # Owner first, status second: a reaper never sees it RUNNING under the old, dead owner.
    new_tags = {**owner_tags(), RESUMED_TAG: str(resumed)}
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in new_tags.items()])
    if FAILURE_REASON_TAG in tags:
        client.delete_tag(run_id, FAILURE_REASON_TAG)
    client.update_run(run_id, status="RUNNING")


def start_system_metrics(run_id: str, resumed: bool = False) -> Any:
    """Start MLflow's system-metrics monitor on the run, in this process: CPU, memory, disk and
    network of this machine (`system/*` metrics), and GPU utilisation and memory where
    `nvidia-ml-py` finds GPUs. Returns the monitor, or None when it cannot start.

    It samples every 10 s (`MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL` overrides it) in a
    background thread; a resumed run continues its step numbers.
    """
    import logging

    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, resume_logging=resumed, tracking_uri=tracking_uri())
        monitor.start()
        return monitor
    except Exception as exc:  # a monitor must never fail the run it watches
        logging.getLogger(__name__).warning("system metrics are off for this run: %s", exc)
        return None


def finish_system_metrics(monitor: Any) -> None:
    """Stop the monitor and log what it sampled since its last publication (MLflow's own stop
    drops it), so a run shorter than the sampling interval still gets one sample."""
    import logging

    if monitor is None:
        return
    try:
        monitor.finish()
        if sampled := monitor.aggregate_metrics():
            monitor.publish_metrics(sampled)
            monitor.mlflow_logger.flush()
    except Exception as exc:
        logging.getLogger(__name__).warning("last system metrics not logged: %s", exc)


@contextlib.contextmanager
def pipeline_run(
    experiment: str,
    run_name: str,
    params: Mapping[str, Any],
    tags: Mapping[str, str] | None = None,
    resume_run_id: str | None = None,
) -> Iterator[str]:
    """Open the pipeline's MLflow run and always close it with the right status.

    Yields the run id. The run ends FINISHED on success, KILLED when stopped (Ctrl-C, SIGTERM,
    a cancelled Prefect run, a preempted node: `is_stop`) and FAILED on any other error, never
    left RUNNING by this process. The run is tagged with its owner (`owner_tags`); RUNNING runs
    whose owner on this host has exited, in any experiment, are marked FAILED first
    (`reap_orphaned_runs`).
    While it is open, MLflow's system metrics of this machine are logged to it
    (`start_system_metrics`).

    With `resume_run_id`, that unfinished run of `experiment` is continued instead of a new one
    (`run_name`, `params` and `tags` are not logged again: the run keeps its own); ValueError if
    it is not in the experiment, already FINISHED, or still running in a live process here.
    """
    import mlflow

    global _last_run_id
    mlflow.set_tracking_uri(tracking_uri())
    client = store_client()
    # Under the lock: two runs starting together must not both create the experiment, and a
    # run being resumed must not be reaped or resumed by another process meanwhile.
    with store_lock():
        experiment_id = _experiment_id(client, experiment)
        reap_orphaned_runs(client)  # every pipeline's, not only this experiment's
        if resume_run_id is None:
            run = client.create_run(
                experiment_id, run_name=run_name, tags={**(tags or {}), **owner_tags()}
            )
            run_id = run.info.run_id
        else:
            _resume(client, experiment, resume_run_id)
            run_id = resume_run_id
    if PARENT_RUN_TAG not in (tags or {}):
        # A nested run (a sweep's trial, in the sweep's own process) is not the one a stopped
        # command continues: the sweep's is (`cli._report_stop`).
        _last_run_id = run_id
    status = "FAILED"
    monitor = start_system_metrics(run_id, resumed=resume_run_id is not None)
    try:
        if resume_run_id is None:
            from mlflow.entities import Param

            items = list(flatten_params(params).items())
            for i in range(0, len(items), 100):
                client.log_batch(run_id, params=[Param(k, v) for k, v in items[i : i + 100]])
        yield run_id
        status = "FINISHED"
    except BaseException as exc:
        if is_stop(exc):
            status = "KILLED"
        raise
    finally:
        finish_system_metrics(monitor)
        client.set_terminated(run_id, status=status)


def find_unfinished_run(experiment: str, tag: str, value: str) -> str | None:
    """The newest run of `experiment` tagged `tag`=`value` that did not finish, else None.

    A retried Prefect flow run finds the MLflow run its earlier attempt opened (tagged with the
    flow run id) and continues it (`pipeline_run(..., resume_run_id=...)`).
    """
    client = store_client()
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    # MLflow's filter language has no escapes: quote with the quote the value lacks, or
    # compare in Python when it has both.
    quote = next((q for q in ("'", '"') if q not in value), None)
    tag_filter = f"tags.`{tag}` = {quote}{value}{quote} and " if quote else ""
    runs = [
        run
        for run in client.search_runs(
            [found.experiment_id],
            filter_string=f"{tag_filter}attributes.status != 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=1 if quote else 1000,
        )
        if run.data.tags.get(tag) == value
    ]
    return runs[0].info.run_id if runs else None


def run_status(run_id: str) -> str:
    """The run's status in the store (RUNNING, FINISHED, FAILED, KILLED, ...)."""
    return str(store_client().get_run(run_id).info.status)


def log_metrics(run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
    """Log a few final metrics (evaluation results) to a run from the orchestrator."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(key, float(value), now, step) for key, value in metrics.items()]
    store_client().log_batch(run_id, metrics=batch)


def register_pytorch_model(
    run_id: str,
    model: Any,
    registered_model_name: str,
    input_example: Any,
    tags: Mapping[str, str],
    requirements: tuple[str, ...] = (),
) -> str:
    """Log `model` (an `nn.Module`) to the run, register it, tag the version; return the version.

    Uses pickle serialization so the registry gives back an `nn.Module` (MLflow 3 defaults to
    an exported graph that loads as a `GraphModule`). Its pip requirements are torch,
    cloudpickle and numpy at their installed versions, plus `requirements` (distribution names).
    """
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    # Versions are numbered by the store: pipelines finishing together register one at a time.
    with store_lock(), mlflow.start_run(run_id=run_id):
        info = mlflow.pytorch.log_model(
            model,
            name="model",
            serialization_format="pickle",
            input_example=input_example,
            pip_requirements=pinned_requirements("torch", "cloudpickle", "numpy", *requirements),
        )
        version = new_model_version(info.model_uri, registered_model_name, run_id)
    return _tag_version(registered_model_name, version, tags)


def new_model_version(model_uri: str, registered_model_name: str, run_id: str | None) -> str:
    """Register the logged model `model_uri` as a new version of `registered_model_name`.

    The name is created only when it does not exist yet: `mlflow.register_model` always tries
    to create it first, which on a shared server is a failed insert (a unique-key error in the
    database's log) for every version after the first.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    # Called under `store_lock` on a store the logging already opened: not `store_client`,
    # which may take that lock again.
    client = MlflowClient(tracking_uri=tracking_uri())
    try:
        client.get_registered_model(registered_model_name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        try:
            client.create_registered_model(registered_model_name)
        except MlflowException as race:  # another run created it meanwhile
            if race.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
                raise
    model_id = model_uri.removeprefix("models:/") if model_uri.startswith("models:/m-") else None
    version = client.create_model_version(
        registered_model_name, source=model_uri, run_id=run_id, model_id=model_id
    )
    return str(version.version)


def pinned_requirements(*distributions: str) -> list[str]:
    """`name==version` of each installed distribution: a logged model's pip requirements.

    Stated rather than inferred: MLflow infers them by loading the model in a subprocess
    (about 20 s on 2 cores) and lists whatever that process happened to import.
    """
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in dict.fromkeys(distributions)]


def _model_card(text: str) -> Any:
    """A Hugging Face model card from markdown (an empty one when there is no text)."""
    from huggingface_hub import ModelCard

    return ModelCard(text or "---\n---\n")


def _tag_version(registered_model_name: str, version: str, tags: Mapping[str, str]) -> str:
    client = store_client()
    for key, value in tags.items():
        client.set_model_version_tag(registered_model_name, version, key, value)
    return version


def registrable_as_is(folder: str | Path, model: Any) -> bool:
    """Whether `folder` holds exactly `model` as `save_pretrained` wrote it, so registration can
    log the folder as it is: a full model (config.json, not a LoRA adapter), nothing beside it
    (no subfolders such as a framework's checkpoints, no training state files), and the same
    configuration as the loaded model (loading for inference may turn off training-only
    settings such as the MoE router loss, which the saved config still has)."""
    from transformers import AutoConfig

    folder = Path(folder)
    if not (folder / "config.json").is_file() or (folder / "adapter_config.json").exists():
        return False
    if any(
        p.is_dir() or p.suffix in (".pt", ".pth", ".distcp") or p.name.startswith("optimizer")
        for p in folder.iterdir()
    ):
        return False
    return AutoConfig.from_pretrained(folder).to_diff_dict() == model.config.to_diff_dict()


def register_transformers_model(
    run_id: str,
    model: Any,
    tokenizer: Any,
    registered_model_name: str,
    input_example: str,
    tags: Mapping[str, str],
    card: str = "",
    *,
    checkpoint: str | Path | None = None,
    scratch_dir: str | Path | None = None,
) -> str:
    """Log a causal LM to the run (`log_transformers_model`), register and tag it. Returns
    the version."""
    uri = log_transformers_model(
        run_id,
        model,
        tokenizer,
        input_example,
        card,
        checkpoint=checkpoint,
        scratch_dir=scratch_dir,
    )
    return register_logged_model(uri, registered_model_name, tags)


def log_transformers_model(
    run_id: str,
    model: Any,
    tokenizer: Any,
    input_example: str,
    card: str = "",
    *,
    checkpoint: str | Path | None = None,
    scratch_dir: str | Path | None = None,
) -> str:
    """Log a causal LM to run `run_id` as an MLflow `transformers` text-generation model;
    returns its model URI (`register_logged_model` registers it).

    MLflow logs a saved checkpoint: given the model object instead, it would load what it
    saved once more and run it on `input_example` (twice the model in memory: minutes, or out
    of memory, for a 20B model; 0.5 s of a tiny run). The pipeline's evaluation has already run
    the model. `checkpoint` is a folder that already holds exactly `model`, as
    `save_pretrained` wrote it (a full fine-tune's output, `registrable_as_is`): it is logged
    as it is, with the tokenizer saved into it if it has none. Otherwise `model` and
    `tokenizer` are saved to a folder in `scratch_dir` (default: the temp folder), removed
    after; give the run's output folder, sized for checkpoints: MLflow stages its own copy in
    the temp folder too. The signature (a prompt in, its generated text out), pip
    requirements (the installed versions of what the pipeline loads the model with), dtype
    and model card (from `card`, a markdown text) are given, not inferred or looked up on the
    Hub.
    """
    import tempfile

    import mlflow
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    requirements = ["torch", "transformers", "tokenizers", "accelerate", "safetensors"]
    if type(model).__module__.startswith("peft"):
        requirements.append("peft")
    mlflow.set_tracking_uri(tracking_uri())
    with contextlib.ExitStack() as stack:
        if checkpoint is None:
            if scratch_dir is not None:
                Path(scratch_dir).mkdir(parents=True, exist_ok=True)
            folder = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="model-", dir=scratch_dir)
            )
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        else:
            folder = str(checkpoint)
            if not (Path(folder) / "config.json").is_file():
                raise FileNotFoundError(f"{folder}: no config.json; not a saved model to register")
            if not (Path(folder) / "tokenizer_config.json").is_file():
                tokenizer.save_pretrained(folder)
        stack.enter_context(store_lock())
        stack.enter_context(mlflow.start_run(run_id=run_id))
        info = mlflow.transformers.log_model(
            transformers_model=folder,
            name="model",
            task="text-generation",
            torch_dtype=model.dtype,
            input_example=input_example,
            signature=ModelSignature(Schema([ColSpec("string")]), Schema([ColSpec("string")])),
            pip_requirements=pinned_requirements(*requirements),
            model_card=_model_card(card),
        )
    return str(info.model_uri)


def register_logged_model(
    model_uri: str, registered_model_name: str, tags: Mapping[str, str]
) -> str:
    """Register a model already logged to a run (`model_uri`) as a new version of
    `registered_model_name`, tagged with `tags`; returns the version. Only metadata moves."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    with store_lock():
        run_id = None
        if model_uri.startswith("models:/m-"):
            run_id = mlflow.get_logged_model(model_uri.removeprefix("models:/")).source_run_id
        version = new_model_version(model_uri, registered_model_name, run_id)
    return _tag_version(registered_model_name, version, tags)


def child_runs(parent_run_id: str) -> dict[str, str]:
    """Run name -> run id of the runs nested under `parent_run_id` (in its experiment)."""
    client = store_client()
    parent = client.get_run(parent_run_id)
    runs = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT_RUN_TAG}` = '{parent_run_id}'",
        max_results=10_000,
    )
    return {run.info.run_name: run.info.run_id for run in runs}


def metric_history(run_id: str, key: str) -> dict[int, float]:
    """Step -> value of metric `key` logged to the run so far (empty when none yet)."""
    return {m.step: m.value for m in store_client().get_metric_history(run_id, key)}


def end_run(run_id: str, status: str, tags: Mapping[str, str]) -> None:
    """Set tags on a run and end it with `status`, e.g. a sweep's trial it stopped early."""
    client = store_client()
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    client.set_terminated(run_id, status=status)


def delete_model_version(registered_model_name: str, version: str) -> None:
    """Remove a version from the registry (its run and artifacts stay)."""
    store_client().delete_model_version(registered_model_name, version)


def set_alias(registered_model_name: str, version: str, alias: str) -> None:
    """Point `alias` (e.g. 'champion') of a registered model at `version`."""
    store_client().set_registered_model_alias(registered_model_name, alias, version)


def log_figure(run_id: str, figure: Any, artifact_file: str) -> None:
    """Attach a matplotlib figure to a run as an image (`artifact_file`, e.g. loss_curve.png)."""
    store_client().log_figure(run_id, figure, artifact_file)


def code_version() -> str:
    """The checkout's commit (`git describe --always --dirty`), or 'unknown' outside git."""
    import subprocess

    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
