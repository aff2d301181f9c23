"""MLflow tracking: one parent run per pipeline run, metrics from rank 0 only, registration.

The orchestrating process creates the store and the run before any rank starts (a fresh SQLite
store created by several ranks at once races); ranks receive only the run id and log through a
buffered sink, so a training step never waits on a tracking-server round trip.
"""

import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from trainflow.paths import safe_name

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


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


def _client() -> Any:
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
    """Sends metrics to an existing MLflow run with MLflow's asynchronous logging.

    MLflow queues the calls and batches them in a background thread, so a training step seldom
    waits on the tracking store; `flush` waits until everything logged so far is stored, and
    happens by itself every `flush_every` calls so the pending operations stay bounded.
    """

    def __init__(self, run_id: str, flush_every: int = 100):
        from mlflow.entities import Metric

        self._metric = Metric
        self.run_id = run_id
        self.client = _client()
        self.flush_every = flush_every
        self.pending: list[Any] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [self._metric(k, float(v), now, step) for k, v in metrics.items()]
        self.pending.append(self.client.log_batch(self.run_id, metrics=batch, synchronous=False))
        if len(self.pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        for operation in pending:
            operation.wait()


PROGRESS_FILE = "progress.json"


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


@contextlib.contextmanager
def pipeline_run(
    experiment: str,
    run_name: str,
    params: Mapping[str, Any],
    tags: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Open the pipeline's MLflow run and always close it with the right status.

    Yields the run id. The run ends FINISHED on success, KILLED on cancellation (Ctrl-C,
    SIGTERM or a cancelled Prefect run) and FAILED on any other error, never left RUNNING.
    """
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    client = _client()
    with store_lock():  # two runs starting together must not both create the experiment
        found = client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id
            if found
            else client.create_experiment(
                experiment, artifact_location=_artifact_location(experiment)
            )
        )
    run = client.create_run(experiment_id, run_name=run_name, tags=dict(tags or {}))
    run_id = run.info.run_id
    from mlflow.entities import Param

    items = list(flatten_params(params).items())
    for i in range(0, len(items), 100):
        client.log_batch(run_id, params=[Param(k, v) for k, v in items[i : i + 100]])
    status = "FAILED"
    try:
        yield run_id
        status = "FINISHED"
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        status = "KILLED"
        raise
    except BaseException as exc:
        # Prefect signals cancellation with its own exception types.
        if "Cancel" in type(exc).__name__ or "Abort" in type(exc).__name__:
            status = "KILLED"
        raise
    finally:
        client.set_terminated(run_id, status=status)


def log_metrics(run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
    """Log a few final metrics (evaluation results) to a run from the orchestrator."""
    sink = MlflowSink(run_id)
    sink.log(step, metrics)
    sink.flush()


def register_pytorch_model(
    run_id: str,
    model: Any,
    registered_model_name: str,
    input_example: Any,
    tags: Mapping[str, str],
) -> str:
    """Log `model` (an `nn.Module`) to the run, register it, tag the version; return the version.

    Uses pickle serialization so the registry gives back an `nn.Module` (MLflow 3 defaults to
    an exported graph that loads as a `GraphModule`).
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
            registered_model_name=registered_model_name,
        )
    return _tag_version(registered_model_name, str(info.registered_model_version), tags)


def _tag_version(registered_model_name: str, version: str, tags: Mapping[str, str]) -> str:
    client = _client()
    for key, value in tags.items():
        client.set_model_version_tag(registered_model_name, version, key, value)
    return version


def register_transformers_model(
    run_id: str,
    model: Any,
    tokenizer: Any,
    registered_model_name: str,
    input_example: str,
    tags: Mapping[str, str],
) -> str:
    """Log a causal LM as an MLflow `transformers` text-generation model, register and tag it.

    The signature is inferred from `input_example` (a prompt). Returns the version.
    """
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    with store_lock(), mlflow.start_run(run_id=run_id):
        info = mlflow.transformers.log_model(
            transformers_model={"model": model, "tokenizer": tokenizer},
            name="model",
            task="text-generation",
            input_example=input_example,
            registered_model_name=registered_model_name,
        )
    return _tag_version(registered_model_name, str(info.registered_model_version), tags)


def set_alias(registered_model_name: str, version: str, alias: str) -> None:
    """Point `alias` (e.g. 'champion') of a registered model at `version`."""
    _client().set_registered_model_alias(registered_model_name, alias, version)


def log_figure(run_id: str, figure: Any, artifact_file: str) -> None:
    """Attach a matplotlib figure to a run as an image (`artifact_file`, e.g. loss_curve.png)."""
    _client().log_figure(run_id, figure, artifact_file)


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
