"""The pipeline skeleton every flow is made of: tracked run -> train -> evaluate -> register.

    with tracked_run(WORKLOADS["mlp"], config) as run:       # MLflow run, lineage, output folder
        trained = train(run, config)                          # the technique's subflow
        evaluation = evaluate(run, trained)                   # held-out metrics
        registration = register(run, config, evaluation, trained)  # gate, version, alias
    return finish(run, config, trained, evaluation, registration)

A failed, timed-out or cancelled step leaves the MLflow run FAILED or KILLED and registers
nothing (`trainflow.tracking.pipeline_run`).

The seams are typed: a config is a `SkeletonConfig` (what the skeleton reads of it), a workload
a `PipelineWorkload` whose module has the `WorkloadHooks`, and the training a `Launch`: the
technique's subflow (`launch_technique`) by default, a framework's own launch for the framework
pipelines (`flows/frameworks.py`), with the same rank slots, progress, stop file and loss curve.
"""

import contextlib
import contextvars
import dataclasses
import json
import re
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, Self, TypeVar, cast, runtime_checkable
from uuid import UUID

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from flows.techniques import techniques
from tasks.reporting import figure_markdown, publish_summary
from trainflow import checkpoint, storage, tracking
from trainflow.cli import start_launch_agent
from trainflow.configs.base import check_resume_config
from trainflow.gate import Threshold, gate_failures
from trainflow.launch.plan import LaunchPlan, check_cpu_oversubscription
from trainflow.paths import RUN_CONFIG_FILE, STOP_FILE
from trainflow.resources import Resources
from trainflow.strategies.job import TrainResult, Workload
from trainflow.strategies.technique import Technique, check_framework
from trainflow.workloads import Evaluation, WorkloadSpec, checked_ahead

R = TypeVar("R", bound="PipelineResult")


class Named(Protocol):
    """What trained the model, as the skeleton names it: a technique, or a framework."""

    @property
    def name(self) -> str: ...


class SkeletonConfig(Protocol):
    """What the skeleton reads of a pipeline's config (`PipelineConfig` subclasses have it all;
    so does `FrameworkConfig`)."""

    @property
    def technique(self) -> Named: ...
    @property
    def experiment_name(self) -> str: ...
    @property
    def registered_model_name(self) -> str: ...
    @property
    def resume(self) -> str | None: ...
    @property
    def parent_run_id(self) -> str | None: ...
    @property
    def gpu_pool(self) -> str | None: ...
    @property
    def gpus(self) -> int: ...
    @property
    def resources(self) -> Resources: ...
    def gate(self) -> list[Threshold]: ...
    def training_fields(self) -> dict[str, Any]: ...
    def model_dump(self, *, mode: str = ..., exclude: Any = ...) -> dict[str, Any]: ...
    def model_dump_json(self) -> str: ...
    def launch_plan(self) -> LaunchPlan: ...
    @classmethod
    def model_validate(cls, obj: Any) -> Self: ...


@runtime_checkable
class WorkloadHooks(Protocol):
    """What the skeleton calls in a workload's module after training (`hooks`)."""

    def evaluate(self, job: Any, trained: TrainResult) -> Evaluation: ...
    def log_model(
        self, job: Any, evaluation: Evaluation, run_id: str, name: str, tags: dict[str, str]
    ) -> str: ...


@runtime_checkable
class ChecksConfig(Protocol):
    """A workload module that checks names its ranks would fail on (`preflight`)."""

    def check_config(self, config: Any) -> None: ...


class PipelineWorkload(Protocol):
    """What the skeleton reads of a workload (`WorkloadSpec`, or a framework's `Framework`)."""

    @property
    def name(self) -> str: ...
    @property
    def title(self) -> str: ...
    @property
    def alias(self) -> str | None: ...
    @property
    def module(self) -> str: ...  # what the launch's agent imports ahead of the ranks
    def load(self) -> ModuleType: ...  # the module with its `WorkloadHooks`


def hooks(workload: PipelineWorkload) -> WorkloadHooks:
    """The workload's module, checked to have the hooks the skeleton calls.

    Raises:
        TypeError: naming the module and the hooks it lacks.
    """
    module = workload.load()
    if not isinstance(module, WorkloadHooks):
        missing = [n for n in ("evaluate", "log_model") if not callable(getattr(module, n, None))]
        raise TypeError(f"workload module {module.__name__} lacks {', '.join(missing)}")
    return module


class PipelineResult(BaseModel):
    """What a pipeline run produced: where things are, the model version, the metrics."""

    mlflow_run_id: str = Field(description="MLflow run holding params, metrics and the model.")
    technique: str = Field(description="Technique that trained the model.")
    registered_model_name: str = Field(description="MLflow registered model name.")
    model_version: str | None = Field(description="Registered version; None if not registered.")
    champion: bool = Field(description="Whether the model passed the gate.")
    alias: str | None = Field(description="Alias the version was given (e.g. champion).")
    prefect_flow_run_id: str = Field(description="This pipeline's Prefect flow run.")
    checkpoint_uri: str | None = Field(description="Last training checkpoint, if any.")
    metrics: dict[str, float] = Field(description="Training and held-out metrics.")
    tracking_uri: str = Field(description="MLflow store the run was logged to.")


class DatasetResult(PipelineResult):
    """What a pipeline that prepares its data produced, and the dataset it trained on."""

    dataset_uri: str = Field(description="Prepared dataset the model was trained on.")


class Beside:
    """Futures of tasks running beside the next steps of a run (the loss plot).

    Not a list on purpose: Prefect waits for every future it finds in a task's parameters,
    and the steps after training take the run as one, so the evaluation would wait for the
    plot it should run beside.
    """

    def __init__(self) -> None:
        self._futures: list[Any] = []

    def add(self, future: Any) -> None:
        self._futures.append(future)

    def wait(self) -> None:
        """Until every one has ended, however."""
        for future in self._futures:
            future.wait()

    def results(self) -> None:
        """Until every one has ended; raises the first one's failure."""
        for future in self._futures:
            future.result()


@dataclass(frozen=True)
class TrackedRun:
    """One pipeline run: its workload, what its ranks get, MLflow run, lineage, output folder."""

    workload: PipelineWorkload
    job: Any
    run_id: str
    output_dir: Path
    lineage: dict[str, str]
    # Tasks submitted to run beside the next steps (the loss plot beside the evaluation); the
    # run waits for them before it ends.
    pending: Beside = field(default_factory=Beside)
    resumed: bool = False  # continues an earlier MLflow run (`--resume`, a flow run's retry)

    @property
    def name(self) -> str:
        return self.workload.name

    @property
    def stop_file(self) -> Path:
        """Creating this file stops the training as a preemption would, with no retry (a
        sweep's pruner does; so can a person)."""
        return self.output_dir / STOP_FILE

    def with_job(self, job: Any) -> "TrackedRun":
        """The same run, its ranks and evaluation given `job`: for inputs staged in the run's
        folder once it exists (a framework's base model). Waits for the same pending tasks."""
        return dataclasses.replace(self, job=job)

    @property
    def artifact_key(self) -> str:
        """The name as Prefect artifact keys allow it (lowercase letters, digits, dashes)."""
        return self.name.replace("_", "-")


@dataclass(frozen=True)
class Registration:
    """What the gate decided: the version (None: not registered), why it failed, the alias."""

    version: str | None
    failures: list[str]
    alias: str | None


@contextlib.contextmanager
def tracked_run(
    workload: PipelineWorkload,
    config: SkeletonConfig,
    lineage: Mapping[str, str] | None = None,
    job: Any = None,
    checked: bool = False,
    params: Mapping[str, Any] | None = None,
) -> Iterator[TrackedRun]:
    """Open the pipeline's MLflow run (config as params, lineage as tags) and output folder.

    Args:
        workload: The registered workload the pipeline runs.
        config: The pipeline's config (has `technique` and `experiment_name`).
        lineage: Extra lineage tags (dataset, base model, ...), also put on the model version.
        job: What the ranks and the evaluation receive, when more than the config (the SFT job
            adds its prepared dataset).
        checked: The flow already ran `preflight` (before preparing its data), or its own
            checks (a framework pipeline's).
        params: Params logged beside the config's (a framework's own settings).
    """
    if not checked:
        if not isinstance(workload, WorkloadSpec):
            raise TypeError(f"{workload.name}: a workload of its own is checked by its flow")
        preflight(workload, config)
    technique = config.technique.name
    flow_run_id = str(flow_run.get_id())
    # A retry of this flow run (same id) continues the MLflow run it started.
    resume = config.resume or tracking.find_unfinished_run(
        config.experiment_name, "prefect_flow_run_id", flow_run_id
    )
    if resume is not None:
        check_resumable(workload, config, resume)
    tags = {
        "technique": technique,
        "prefect_flow_run_id": flow_run_id,
        "code_version": tracking.code_version(),
        **(lineage or {}),
    }
    if config.parent_run_id:
        tags[tracking.PARENT_RUN_TAG] = config.parent_run_id
    with (
        _agent_ahead(workload, config),
        tracking.pipeline_run(
            config.experiment_name,
            run_name=f"{workload.name}-{technique}-{flow_run.get_name() or 'local'}",
            params=config.model_dump() | dict(params or {}),
            tags=tags,
            resume_run_id=resume,
        ) as run_id,
    ):
        # A framework pipeline's config has no `output_root`: its runs stay under the home.
        output_root = getattr(config, "output_root", None)
        output_dir = storage.local_run_dir(workload.name, run_id, output_root)
        output_dir.mkdir(parents=True, exist_ok=True)
        if resume is None:
            # A stop file here is this run's own and stays: a sweep may ask a trial to stop
            # as soon as its MLflow run exists.
            saved = config.model_dump(mode="json", exclude={"resume"})
            (output_dir / RUN_CONFIG_FILE).write_text(json.dumps(saved, indent=2))
        else:
            (output_dir / STOP_FILE).unlink(missing_ok=True)  # what stopped its earlier attempt
        # Kept in object storage: its config goes up, a resume elsewhere fetches its checkpoint.
        remote = storage.remote_run_uri(workload.name, run_id, output_root)
        keep = getattr(config, "keep_checkpoints", 1)
        if (downloaded := storage.open_run(remote, output_dir, keep)) is not None:
            print(f"downloaded checkpoint {downloaded.name} from {remote}")
        verb = "continuing" if resume else "started"
        print(
            f"MLflow run {run_id} {verb} (experiment {config.experiment_name!r}); if it "
            f"stops, continue it with: python -m flows.{workload.name} --resume {run_id}"
        )
        job = config if job is None else job
        run = TrackedRun(workload, job, run_id, output_dir, tags, resumed=resume is not None)
        try:
            yield run
        except BaseException:
            run.pending.wait()
            raise
        run.pending.results()  # a step that failed beside the others fails the run


@contextlib.contextmanager
def _agent_ahead(workload: PipelineWorkload, config: SkeletonConfig) -> Iterator[None]:
    """Start the training launch's agent now, importing the workload's modules while the run
    opens; the launch uses it, or it is stopped when the run ends (`start_launch_agent`)."""
    discard = start_launch_agent(config, workload.module)
    try:
        yield
    finally:
        discard()


def check_resumable(workload: PipelineWorkload, config: SkeletonConfig, run_id: str) -> None:
    """Refuse to continue `run_id` with a config that trains something else
    (`check_resume_config`: the command line checks the same before anything starts)."""
    # Every pipeline's config is a pydantic model (`PipelineConfig`, `FrameworkConfig`).
    check_resume_config(workload.name, cast(BaseModel, config), run_id)


def preflight(workload: WorkloadSpec, config: SkeletonConfig) -> None:
    """Refuse, before the MLflow run exists, what cannot run here: GPUs this machine lacks, far
    more CPU ranks than cores, a technique the workload's framework cannot use on the resolved
    device, or names the workload's own `check_config` rejects (a scheduler, LoRA targets).

    The technique subflow checks again with the model itself (built on the meta device).
    """
    plan = config.launch_plan()
    check_cpu_oversubscription(plan)
    technique = config.technique
    if not isinstance(technique, Technique):
        raise TypeError(f"technique {technique.name!r}: resolve it before the preflight")
    check_framework(technique, workload.framework, device_type=plan.device)
    if checked_ahead(workload.name, config):
        return  # by the launch agent, with the workload's libraries loaded there
    module = workload.load()
    if isinstance(module, ChecksConfig):
        module.check_config(config)


ConfigT = TypeVar("ConfigT", bound=SkeletonConfig, contravariant=True)
C = TypeVar("C", bound=SkeletonConfig)


class Launch(Protocol[ConfigT]):
    """The training step's launch: the ranks trained on the run's config; rank 0's result.

    It runs while the skeleton holds the config's rank slots and follows the progress file in
    the run's folder (`tracking.PROGRESS_FILE`, which rank 0 writes); it stops the ranks when
    the run's `stop_file` appears.
    """

    def __call__(self, run: TrackedRun, config: ConfigT, /) -> TrainResult: ...


def train(run: TrackedRun, config: C, launch: Launch[C] | None = None) -> TrainResult:
    """Train on the config's ranks with `launch` (default: its technique's subflow,
    `launch_technique`) holding its rank slots; show progress and the loss."""
    step: Launch[C] = launch_technique if launch is None else launch
    checkpoints = run.output_dir / "checkpoints"
    checkpoint.remove_partial(checkpoints)
    if (latest := checkpoint.latest_checkpoint(checkpoints)) is not None:
        print(f"continuing training from {latest} (step {checkpoint.read_meta(latest)['step']})")
    try:
        with _rank_slots(config.gpu_pool, config.gpus), _progress(run):
            trained = step(run, config)
    finally:
        # A save the stop interrupted is never resumed from; do not leave it behind.
        checkpoint.remove_partial(checkpoints)
        _remove_stale_shared_memory()
    # Plotted while the model is evaluated (matplotlib's import and the drawing take seconds).
    run.pending.add(publish_loss_curve.submit(run.artifact_key, run.run_id, trained.history))
    return trained


def launch_technique(run: TrackedRun, config: SkeletonConfig) -> TrainResult:
    """The workload on every rank through its technique's subflow, continuing from the run's
    latest checkpoint (a torch elastic restart, a Prefect retry, `--resume`)."""
    if not isinstance(run.workload, WorkloadSpec):
        raise TypeError(f"{run.name}: a workload of its own trains with its own launch")
    workload = Workload(
        train_fn=run.workload.ref("train"),
        model_fn=run.workload.ref("build_model"),
        config=run.job,
        output_dir=str(run.output_dir),
        framework=run.workload.framework,
        backend=getattr(config, "backend", "auto"),
        mlflow_run_id=run.run_id,
        resume_from=str(run.output_dir / "checkpoints"),
        checked_ahead=checked_ahead(run.workload.name, config),
    )
    trained: TrainResult = techniques[config.technique.name](
        workload=workload, technique=config.technique, resources=config.resources
    )
    return trained


@contextlib.contextmanager
def _rank_slots(pool: str | None, ranks: int) -> Iterator[None]:
    """Hold `ranks` slots of the Prefect global concurrency limit `pool` while the ranks run.

    Only training holds them: a run's start-up, evaluation and registration leave the ranks'
    devices to the next run. `strict`: a pool that does not exist is an error, not no limit.
    """
    if pool is None:
        yield
        return
    from prefect.concurrency.sync import concurrency

    with concurrency(pool, occupy=ranks, strict=True):
        yield


def _remove_stale_shared_memory() -> None:
    """Remove the data streams' shared memory that ranks stopped mid-epoch left behind.

    `streaming` frees it only on a clean exit; ranks killed after their stop grace cannot.
    Only memory no live process maps is removed, so other runs on the machine are safe; the
    cleaner (which imports `streaming`) loads only when there is something to look at.
    """
    shm = Path("/dev/shm")

    def streams_left() -> bool:
        return shm.is_dir() and any(re.match(r"\d{6}_", p.name) for p in shm.iterdir())

    if streams_left():
        from trainflow.data.shm import GRACE_S, clean_stale_streaming_state, too_young_to_judge

        clean_stale_streaming_state()
        if too_young_to_judge():
            # What the ranks wrote just before they stopped is too young to be judged yet (it
            # could be another run's, not mapped yet); look again once it is not. What live
            # processes map (other runs on the machine) is not waited for.
            time.sleep(GRACE_S)
            clean_stale_streaming_state()


@task(name="evaluate", task_run_name="evaluate-{run.name}", cache_policy=NO_CACHE)
def evaluate(run: TrackedRun, trained: TrainResult) -> Evaluation:
    """Held-out metrics of the trained model, logged to the run: the ones rank 0 computed
    right after training when the workload's ranks evaluate (SFT), else computed here."""
    if trained.evaluation is not None:
        evaluation = Evaluation(
            trained.evaluation.metrics, logged_model_uri=trained.evaluation.logged_model_uri
        )
    else:
        evaluation = hooks(run.workload).evaluate(run.job, trained)
    tracking.log_metrics(run.run_id, evaluation.metrics)
    return evaluation


def register(
    run: TrackedRun, config: SkeletonConfig, evaluation: Evaluation, trained: TrainResult
) -> Registration:
    """Check the gate, then log and register the model.

    A workload without an alias registers only a model that passes the gate; one with an
    alias (SFT's `champion`) registers every finished run and moves the alias only past it.
    A nested run (a sweep's trial) never moves the alias: its parent chooses the best trial.
    """
    failures = gate_failures(config.gate(), evaluation.metrics)
    alias = run.workload.alias
    for failure in failures:
        outcome = f"no {alias} alias" if alias else "not registered"
        print(f"gate not passed: {failure}; {outcome}")
    if failures and alias is None:
        return Registration(None, failures, None)
    tags = run.lineage | {
        "mlflow_run_id": run.run_id,
        "world_size": str(trained.world_size),
        "checkpoint_uri": trained.checkpoint_uri or "",
    }
    given = alias if not failures and not config.parent_run_id else None
    version = _register_model(run, config.registered_model_name, evaluation, tags, given)
    return Registration(version, failures, given)


@task(name="register-model", cache_policy=NO_CACHE)
def _register_model(
    run: TrackedRun,
    name: str,
    evaluation: Evaluation,
    tags: dict[str, str],
    alias: str | None,
) -> str:
    """Log the model to the run (unless rank 0 did), add a registry version with `tags`,
    point `alias` at it."""
    if evaluation.logged_model_uri is not None:
        version = tracking.register_logged_model(evaluation.logged_model_uri, name, tags)
    else:
        version = hooks(run.workload).log_model(run.job, evaluation, run.run_id, name, tags)
    if alias:
        tracking.set_alias(name, version, alias)
    return version


def finish(
    run: TrackedRun,
    config: SkeletonConfig,
    trained: TrainResult,
    evaluation: Evaluation,
    registration: Registration,
    result_type: type[R] = PipelineResult,  # type: ignore[assignment]
    **extra: Any,
) -> R:
    """Publish the run's summary artifact and return the pipeline's result."""
    metrics = trained.metrics | evaluation.metrics
    version, passed = registration.version, not registration.failures
    model = f"{config.registered_model_name} v{version}" if version else "not registered"
    if registration.alias:
        model += f" ({registration.alias})"
    elif version and run.workload.alias and not passed:
        model += " (gate not passed: no alias)"
    publish_summary(
        f"{run.artifact_key}-summary",
        title=f"{run.workload.title} pipeline",
        config=config.model_dump(),
        metrics=metrics,
        model=model,
        mlflow_run_id=run.run_id,
    )
    return result_type(
        mlflow_run_id=run.run_id,
        technique=config.technique.name,
        registered_model_name=config.registered_model_name,
        model_version=version,
        champion=version is not None and passed,
        alias=registration.alias,
        prefect_flow_run_id=run.lineage["prefect_flow_run_id"],
        checkpoint_uri=trained.checkpoint_uri,
        metrics=metrics,
        tracking_uri=tracking.tracking_uri(),
        **extra,
    )


@task(name="publish-loss-curve", cache_policy=NO_CACHE)
def publish_loss_curve(name: str, run_id: str, history: dict[int, dict[str, float]]) -> str:
    """Plot the training loss, attach it to the MLflow run and show it in Prefect."""
    from trainflow.plots import loss_curve

    figure = loss_curve(history, f"{name}: training loss")
    tracking.log_figure(run_id, figure, "loss_curve.png")
    return str(
        create_markdown_artifact(
            key=f"{name}-loss-curve",
            markdown=f"# {name} training loss\n\n{figure_markdown(figure, 'loss curve')}\n",
            description="Training loss by step",
        )
    )


@contextlib.contextmanager
def _progress(run: TrackedRun, poll_s: float = 2.0) -> Iterator[None]:
    """A progress artifact that follows rank 0's progress file while training runs.

    Ranks never talk to Prefect: rank 0 writes the file and this thread forwards it.
    """
    # Called from a sync flow, Prefect's dual sync/async API returns the id itself.
    artifact_id = cast(
        UUID,
        create_progress_artifact(
            progress=0.0,
            key=f"{run.artifact_key}-progress",
            description="Training steps done (%)",
        ),
    )
    progress_file = run.output_dir / tracking.PROGRESS_FILE
    stop = threading.Event()

    def forward() -> None:
        last: float | None = None
        while not stop.wait(poll_s):
            done = tracking.read_progress(progress_file)
            if done is not None and done != last:
                update_progress_artifact(artifact_id, done)
                last = done

    # The thread runs in this flow's context: same Prefect settings and client as the flow.
    context = contextvars.copy_context()
    thread = threading.Thread(
        target=context.run, args=(forward,), name=f"{run.name}-progress", daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        done = tracking.read_progress(progress_file)
        if done is not None:
            update_progress_artifact(artifact_id, done)
