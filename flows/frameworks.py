"""The pipeline around a framework launched its own way: prepare -> train -> evaluate -> register.

`flows/axolotl.py`, `flows/llm_foundry.py` and `flows/unsloth.py` are this pipeline with their
framework. The framework trains with its own config file and entry point on our ranks, in its
own virtual environment (`LaunchOptions.python`). The rest is the pipeline skeleton every
pipeline is made of (`flows/skeleton.py`), with the framework's launch as its training step:

    with tracked_run(workload, config, lineage, job, checked=True) as run:  # MLflow run, --resume
        run = run.with_job(stage_inputs(run))       # base model and data where it reads them
        trained = train(run, config, launch_framework)  # rank slots, progress, stop file
        evaluation = evaluate(run, trained)           # held-out split, against the base model
        registration = register(run, config, evaluation, trained)  # champion past the gate
    return finish(...)

A failure or a stop leaves the MLflow run FAILED or KILLED and registers nothing; a sweep's
trial (`parent_run_id`) never moves the alias. A framework cannot continue from a checkpoint of
ours: `--resume RUN_ID` continues the same MLflow run and trains again from the start.
"""

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from flows.skeleton import (
    DatasetResult,
    TrackedRun,
    evaluate,
    finish,
    register,
    tracked_run,
    train,
)
from tasks.data import prepare_dataset
from tasks.techniques import retry_if_transient
from trainflow import tracking
from trainflow.configs.frameworks import Framework, FrameworkConfig, read_framework_config
from trainflow.frameworks.startup import check_environment, check_setup
from trainflow.strategies.job import TrainResult

if TYPE_CHECKING:  # the framework side imports transformers: loaded when a run needs it
    from trainflow.frameworks.pipeline import FrameworkJob


def run_framework(framework: Framework, config: FrameworkConfig) -> DatasetResult:
    """The pipeline: prepare the data, train with the framework, evaluate, register."""
    from trainflow.frameworks.pipeline import FrameworkJob, installed_version

    config = check_setup(framework, config)
    python = config.interpreter(framework)
    versions = check_environment(framework, config)
    print(f"{framework.title} environment: {python} ({versions})")
    data = prepare_dataset(config.data_config(framework))
    lineage = {
        "framework": framework.name,
        "framework_environment": versions,
        "framework_version": installed_version(python, framework.name),
        "framework_config": Path(config.framework_config).name,
        "dataset_uri": data.uri,
        "dataset_fingerprint": data.fingerprint,
        "base_model": config.base_model,
    }
    settings = {"framework_settings": read_framework_config(config.framework_config)}
    job = FrameworkJob(config, data.uri)
    with tracked_run(
        framework.workload, config, lineage, job, checked=True, params=settings
    ) as run:
        run = run.with_job(stage_inputs(run))
        trained = train(run, config, launch_framework)
        evaluation = evaluate(run, trained)
        registration = register(run, config, evaluation, trained)
    return finish(
        run, config, trained, evaluation, registration, DatasetResult, dataset_uri=data.uri
    )


@task(name="stage-framework-inputs", task_run_name="stage-{run.name}-inputs", cache_policy=NO_CACHE)
def stage_inputs(run: TrackedRun) -> "FrameworkJob":
    """The run's job with the base model and the data where the framework reads them, in the
    run's folder (`trainflow.frameworks.pipeline.stage_inputs`)."""
    from trainflow.frameworks.pipeline import stage_inputs as stage

    return stage(run.job, run.output_dir)


def launch_framework(run: TrackedRun, config: FrameworkConfig) -> TrainResult:
    """The framework's own training on the config's ranks, in its environment (the skeleton's
    training step): rank 0's report as a `TrainResult`.

    Rank output goes to this flow run's logs (`launch_logged`), a failing rank is named in
    the error, rank 0 writes the run's progress file, the run's stop file stops the ranks, and
    the loss history the framework reported is logged to the MLflow run.
    """
    from trainflow.frameworks.pipeline import train_metrics, train_result

    framework, job = config.technique, run.job
    progress_file = run.output_dir / tracking.PROGRESS_FILE
    if run.resumed:
        print(
            f"{framework.title} cannot continue from a checkpoint: it trains again from the "
            f"start, in MLflow run {run.run_id}"
        )
        progress_file.unlink(missing_ok=True)  # the earlier attempt's
    model_dir = run.output_dir / "model"
    rank_side = framework.rank_module()
    overrides = rank_side.pipeline_overrides(
        base_model=job.base_model,
        tokenizer=config.tokenizer_path(),
        data=job.train_data,
        output_dir=str(model_dir),
        max_steps=config.max_steps,
        max_length=config.max_length,
    )
    attempt = _train_with_framework.with_options(
        task_run_name=f"train-with-{framework.name}",
        retries=config.retries,
        retry_condition_fn=retry_if_transient,
    )
    result: dict[str, Any] = attempt(
        rank_side.train,
        config.framework_config,
        overrides,
        config.launch_options(stop_file=str(run.stop_file)),
        model_dir,
        progress_file=str(progress_file),
    )
    sink = tracking.MlflowSink(run.run_id)
    for step, loss in result.get("loss_history") or []:
        sink.log(int(step), {"train_loss": float(loss)})
    sink.flush()
    tracking.log_metrics(run.run_id, train_metrics(result))
    return train_result(framework, result)


@task(name="train-with-framework", cache_policy=NO_CACHE, persist_result=False)
def _train_with_framework(
    rank_train: Any,
    config_file: str,
    overrides: dict[str, Any],
    options: Any,
    model_dir: Path,
    progress_file: str | None = None,
) -> dict[str, Any]:
    """One launch of the framework on every rank; rank 0's report. Retried (`--retries`) after
    a failure a relaunch can fix (a killed rank, a lost peer, a hang, a timeout); each attempt
    trains from the start, with no half-saved model of an earlier one left behind."""
    from trainflow.launch.backends import launch_logged

    shutil.rmtree(model_dir, ignore_errors=True)
    kwargs = {} if progress_file is None else {"progress_file": progress_file}
    values = launch_logged(rank_train, (config_file, overrides), kwargs, options).values
    return values[0]  # type: ignore[no-any-return]
