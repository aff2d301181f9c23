"""The pipeline around a framework launched its own way: prepare -> train -> evaluate -> register.

`flows/axolotl.py`, `flows/llm_foundry.py` and `flows/unsloth.py` are this pipeline with their
framework. The framework trains with its own config file and entry point on our ranks, in its
own virtual environment (`LaunchOptions.python`); everything else is the same as in the SFT
pipeline: the data task prepares the data, the MLflow run ends FAILED or KILLED on a failure or
a stop and registers nothing then, the trained model is scored on the held-out split against
the model it started from, and registered with the champion alias past the gate.
"""

import dataclasses
import functools
import shutil
import sys
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows.skeleton import DatasetResult
from tasks.data import prepare_dataset
from tasks.reporting import publish_summary
from tasks.techniques import retry_if_transient
from trainflow import tracking
from trainflow.configs.frameworks import (
    PRESETS_DIR,
    Framework,
    FrameworkConfig,
    FrameworkSetupError,
    read_framework_config,
)
from trainflow.data import PreparedDataset
from trainflow.gate import gate_failures
from trainflow.launch.plan import check_cpu_oversubscription
from trainflow.paths import run_output_dir

SUMMARY_METRICS = [
    "train_loss",
    "steps",
    "untrained_loss",
    "eval_loss",
    "eval_perplexity",
    "eval_exact_match",
    "train_runtime_s",
]


def check_setup(framework: Framework, config: FrameworkConfig) -> FrameworkConfig:
    """What can be checked in a second, before the Prefect server or any rank starts: the config
    file, the framework's environment, the ranks' device. Returns the config resolved
    (`FrameworkConfig.resolved`: the model and sequence length from the file when not given).

    Raises:
        FrameworkSetupError: naming the file, the environment (and the command that makes it) or
            why the framework cannot train on these ranks.
    """
    config = config.resolved(framework)  # a config file that names no model fails here
    python = config.interpreter(framework)
    if not python.exists():
        where = "--python" if config.python else f".venvs/{framework.name}"
        raise FrameworkSetupError(
            f"{framework.title} runs in its own environment, and {python} does not exist "
            f"({where}): create it with `{framework.setup_command()}`"
        )
    plan = config.launch_plan()
    check_cpu_oversubscription(plan)
    # The framework's own say on this device and config (Unsloth: a config that needs a GPU).
    can_train = getattr(framework.rank_module(), "check_can_train", None)
    if plan.device == "cpu" and can_train is not None:
        reason = can_train(config.framework_config)
        if reason:
            raise FrameworkSetupError(
                f"{framework.title} cannot train on CPU ranks: {reason}. Run it where CUDA GPUs "
                "are (--gpu-type H100 --gpus 8, or a GPU deployment)"
            )
    return config


def check_environment(framework: Framework, config: FrameworkConfig) -> str:
    """The environment can start our ranks (torch and trainflow import there); its versions."""
    from trainflow.errors import LaunchConfigError
    from trainflow.launch.environment import check_interpreter

    try:
        return check_interpreter(str(config.interpreter(framework)))
    except LaunchConfigError as exc:
        hint = f"(for {framework.title}: `{framework.setup_command()}`)"
        raise FrameworkSetupError(f"{exc} {hint}") from None


def run_framework(framework: Framework, config: FrameworkConfig) -> DatasetResult:
    """The pipeline: prepare the data, train with the framework, evaluate, register."""
    config = check_setup(framework, config)
    python = config.interpreter(framework)
    versions = check_environment(framework, config)
    print(f"{framework.title} environment: {python} ({versions})")
    data = prepare_dataset(config.data_config(framework))
    lineage = {
        "framework": framework.name,
        "framework_environment": versions,
        "framework_config": Path(config.framework_config).name,
        "dataset_uri": data.uri,
        "dataset_fingerprint": data.fingerprint,
        "base_model": config.base_model,
        "prefect_flow_run_id": str(flow_run.get_id()),
        "code_version": tracking.code_version(),
    }
    with tracking.pipeline_run(
        config.experiment_name,
        run_name=f"{framework.name}-{flow_run.get_name() or 'local'}",
        params=config.model_dump()
        | {"framework_settings": read_framework_config(config.framework_config)},
        tags=lineage,
    ) as run_id:
        out = run_output_dir(framework.name, run_id)
        out.mkdir(parents=True, exist_ok=True)
        base_model, data_path = stage_inputs(framework, config, data, out)
        result = train(framework, config, python, base_model, data_path, out, run_id)
        metrics, version, alias = evaluate_and_register(
            framework, config, data, base_model, result, run_id, lineage
        )
    metrics = train_metrics(result) | metrics
    model = f"{config.registered_model_name} v{version}" + (f" ({alias})" if alias else "")
    publish_summary(
        f"{framework.name}-summary",
        title=f"{framework.title} pipeline",
        config=config.model_dump(),
        metrics=metrics,
        model=model,
        mlflow_run_id=run_id,
    )
    return DatasetResult(
        mlflow_run_id=run_id,
        technique=framework.name,
        registered_model_name=config.registered_model_name,
        model_version=version,
        champion=alias is not None,
        alias=alias,
        prefect_flow_run_id=lineage["prefect_flow_run_id"],
        checkpoint_uri=None,
        metrics=metrics,
        tracking_uri=tracking.tracking_uri(),
        dataset_uri=data.uri,
    )


@task(name="stage-framework-inputs", cache_policy=NO_CACHE)
def stage_inputs(
    framework: Framework, config: FrameworkConfig, data: PreparedDataset, out: Path
) -> tuple[str, str]:
    """The base model and the data where the framework reads them: the tiny model saved as a
    model folder; the prepared MDS dataset, or its training rows as chat JSONL."""
    from trainflow.frameworks.pipeline import export_chat_jsonl, stage_base_model

    base_model = stage_base_model(config, out / "base_model")
    if framework.data_format == "mds":
        return base_model, data.uri
    return base_model, str(export_chat_jsonl(config.data_config(), out / "data" / "train.jsonl"))


def train(
    framework: Framework,
    config: FrameworkConfig,
    python: Path,
    base_model: str,
    data_path: str,
    out: Path,
    run_id: str,
) -> dict[str, Any]:
    """The framework's own training on the config's ranks, in its environment; rank 0's report.

    Rank output goes to this flow run's logs (`launch_logged`), a failing rank is named in
    the error, and the loss history the framework reported is logged to the MLflow run.
    """
    model_dir = out / "model"
    rank_side = framework.rank_module()
    overrides = rank_side.pipeline_overrides(
        base_model=base_model,
        tokenizer=config.tokenizer_path(),
        data=data_path,
        output_dir=str(model_dir),
        max_steps=config.max_steps,
        max_length=config.max_length,
    )
    options = dataclasses.replace(config.launch_options(), python=str(python))
    attempt = _train_with_framework.with_options(
        task_run_name=f"train-with-{framework.name}",
        retries=config.retries,
        retry_condition_fn=retry_if_transient,
    )
    result: dict[str, Any] = attempt(
        rank_side.train, config.framework_config, overrides, options, model_dir
    )
    sink = tracking.MlflowSink(run_id)
    for step, loss in result.get("loss_history") or []:
        sink.log(int(step), {"train_loss": float(loss)})
    sink.flush()
    tracking.log_metrics(run_id, train_metrics(result))
    return result


@task(name="train-with-framework", cache_policy=NO_CACHE, persist_result=False)
def _train_with_framework(
    rank_train: Any, config_file: str, overrides: dict[str, Any], options: Any, model_dir: Path
) -> dict[str, Any]:
    """One launch of the framework on every rank; rank 0's report. Retried (`--retries`) after
    a failure a relaunch can fix (a killed rank, a lost peer, a hang, a timeout); each attempt
    trains from the start, with no half-saved model of an earlier one left behind."""
    from trainflow.launch.backends import launch_logged

    shutil.rmtree(model_dir, ignore_errors=True)
    values = launch_logged(rank_train, (config_file, overrides), {}, options).values
    return values[0]  # type: ignore[no-any-return]


def train_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The numbers of rank 0's report that are metrics."""
    names = {
        "train_loss": "train_loss",
        "global_step": "steps",
        "train_runtime_s": "train_runtime_s",
    }
    return {
        name: float(result[key])
        for key, name in names.items()
        if isinstance(result.get(key), int | float)
    }


@task(name="evaluate-and-register", cache_policy=NO_CACHE)
def evaluate_and_register(
    framework: Framework,
    config: FrameworkConfig,
    data: PreparedDataset,
    base_model: str,
    result: dict[str, Any],
    run_id: str,
    lineage: dict[str, str],
) -> tuple[dict[str, float], str, str | None]:
    """Score the trained model on the held-out split against its base, log the metrics,
    register it, and give it the champion alias past the gate."""
    from trainflow.frameworks.pipeline import evaluate, model_card, trained_model_dir

    trained = trained_model_dir(result)
    metrics, model, example = evaluate(config, data.uri, base_model, trained)
    tracking.log_metrics(run_id, metrics)
    failures = gate_failures(config.sft_view().gate(), metrics)
    for failure in failures:
        print(f"gate not passed: {failure}; no champion alias")
    tags = lineage | {"mlflow_run_id": run_id, "framework_version": str(result.get("version", ""))}
    from trainflow.data.tokenizer import load_tokenizer

    version = tracking.register_transformers_model(
        run_id,
        model,
        load_tokenizer(config.tokenizer_path()),
        config.registered_model_name,
        example,
        tags,
        card=model_card(framework, config, metrics, tags),
        # The framework's folder may hold more than the model (its checkpoints, logs): the
        # model is saved again, beside it on the run's disk, unless the folder is the model.
        checkpoint=trained if tracking.registrable_as_is(trained, model) else None,
        scratch_dir=trained.parent,
    )
    alias = None if failures else "champion"
    if alias:
        tracking.set_alias(config.registered_model_name, version, alias)
    return metrics, version, alias


def cli_argv(argv: list[str] | None) -> list[str]:
    """`python -m flows.NAME CONFIG.yaml [options]`: the positional config file becomes
    `--framework-config`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-"):
        args = ["--framework-config", args[0], *args[1:]]
    return args


def main(flow: Any, framework: Framework, argv: list[str] | None, doc: str | None) -> Any:
    """`python -m flows.NAME [CONFIG.yaml] [options]`, with the shipped tiny config by default."""
    from flows.local_server import starting_prefect_server
    from trainflow.cli import run_pipeline

    defaults = FrameworkConfig(
        framework_config=str(PRESETS_DIR / framework.tiny_config),
        registered_model_name=f"{framework.name}-sft",
    )
    return run_pipeline(
        flow,
        defaults,
        cli_argv(argv),
        doc,
        summary_metrics=SUMMARY_METRICS,
        server=starting_prefect_server,
        check=functools.partial(_check, check_setup, framework),
        deep_check=functools.partial(_check, check_environment, framework),
    )


def _check(check: Any, framework: Framework, config: FrameworkConfig) -> None:
    check(framework, config)
