"""Supervised fine-tuning of a causal LM: prepare -> train -> evaluate -> register.

The `debug_cpu` preset (default) fine-tunes a tiny Llama on the shipped instruction data with
DDP on 2 CPU ranks in a few minutes. Run locally (local Prefect, SQLite MLflow store
`mlflow.db`)::

    python -m flows.sft
    python -m flows.sft --technique fsdp --max-steps 50 --lora
    python -m flows.sft --preset h100          # Llama-3.2-1B-Instruct on trl-lib/Capybara
    python -m flows.sft --preset gpt-oss-20b   # also gpt-oss-120b, llama-3.2-1b-zero3
    python -m flows.sft --preset gpt-oss-120b --technique auto --gpu-memory-gb 141
    python -m flows.sft --model meta-llama/Llama-3.2-1B-Instruct --dataset trl-lib/Capybara \\
        --gpus 8 --gpu-type H100 --technique deepspeed
    python -m flows.sft --help

Before launch the flow prints the memory estimate per GPU (`trainflow.memory`), refuses a run
that does not fit the GPUs, and resolves `--technique auto` to the technique that fits.

Deploy: `prefect --no-prompt deploy --name sft/cpu-local` (see prefect.yaml).
"""

import functools
import importlib
import sys
from typing import Any

from trainflow import tracking
from trainflow.cli import pipeline_config, run_pipeline, start_ahead, start_launch_agent
from trainflow.configs.sft import SFTConfig, SFTJob, load_sft_preset, sft_preset_names
from trainflow.data import ahead as data_ahead
from trainflow.memory import MemoryPlan, plan_sft, remember_shape
from trainflow.workloads import WORKLOADS, record_checked_ahead

SFT = WORKLOADS["sft"]
CHECKS = "trainflow.workloads.sft_checks"  # what the launch's agent checks first
# What this process needs once the run starts, imported while it waits for the agent's checks:
# the run's tracking (MLflow's store) and the loss plot's drawing.
WHILE_WAITING = (
    "mlflow",
    *tracking.SINK_IMPORTS,
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
)
PRESETS = {name: functools.partial(load_sft_preset, name) for name in sft_preset_names()}


def _check_files(config: SFTConfig) -> None:
    """The data files' checks: they need no torch or transformers, so a bad row fails in
    about a second, before the Prefect server starts."""
    from trainflow.data.checks import check_files

    check_files(config.data_config())


def _start_agent(config: SFTConfig) -> Any:
    """The training launch's agent, started now (or the one already started for `config`),
    asked to check `config` first (`sft_checks.check_ahead`), then to prepare its dataset,
    where `datasets`, `streaming` and the tokenizer are imported for the ranks anyway
    (`trainflow.data.ahead`: the prepare task waits for it)."""
    return start_launch_agent(
        config,
        SFT.module,
        check=(f"{CHECKS}:check_ahead", config.model_dump(mode="json")),
        then=[data_ahead.prepare_call(config.data_config())],
    )


if __name__ == "__main__":
    # `python -m flows.sft`: the agent starts before this process imports Prefect
    # (`trainflow.cli.start_ahead`); the imports below take a second of one core.
    start_ahead(
        "sft", load_sft_preset("debug_cpu"), sys.argv[1:], PRESETS, _check_files, _start_agent
    )

from prefect import flow  # noqa: E402  (after the agent has started, above)

from flows.skeleton import (  # noqa: E402
    DatasetResult,
    evaluate,
    finish,
    preflight,
    register,
    tracked_run,
    train,
)
from tasks.data import prepare_dataset  # noqa: E402


@flow(name="sft", log_prints=True)
def sft(config: SFTConfig = load_sft_preset("debug_cpu")) -> DatasetResult:
    """Fine-tune a causal LM: prepare -> train -> evaluate -> register (alias past the gate)."""
    plan = plan_memory(config)  # refuses what does not fit; `auto` becomes a technique here
    config = config.with_technique(plan.technique)
    preflight(SFT, config)  # before the data is prepared, which can take long
    data = prepare_dataset(config.data_config())
    lineage = {
        "dataset_uri": data.uri,
        "dataset_fingerprint": data.fingerprint,
        "base_model": config.model,
        "lora": str(config.lora).lower(),
    }
    # Rank 0 evaluates the trained model and logs it right after training, where the model
    # and its libraries are loaded: this process only registers it.
    job = SFTJob(config=config, data=data, evaluate_on_ranks=True)
    with tracked_run(SFT, config, lineage, job=job, checked=True) as run:
        record_memory_plan(run.run_id, plan)
        trained = train(run, config)
        evaluation = evaluate(run, trained)
        registration = register(run, config, evaluation, trained)
    return finish(
        run, config, trained, evaluation, registration, DatasetResult, dataset_uri=data.uri
    )


def plan_memory(config: SFTConfig) -> MemoryPlan:
    """The memory estimate per GPU, printed; `technique: auto` resolved.

    Raises:
        MemoryFitError: the technique (for auto: every candidate) does not fit the GPUs.
    """
    plan = plan_sft(config)
    for line in plan.lines():
        print(line)
    return plan


def record_memory_plan(run_id: str, plan: MemoryPlan) -> None:
    """The estimate and the technique chosen as `memory.*` params of the run; a continued run
    keeps the values it was started with."""
    client = tracking.store_client()
    logged = client.get_run(run_id).data.params
    for key, value in plan.params().items():
        if key not in logged:
            client.log_param(run_id, key, value)


SUMMARY_METRICS = [
    f"{when}_{name}"
    for name in ("loss", "perplexity", "exact_match")
    for when in ("untrained", "eval")
] + ["train_runtime", "eff_tokens_per_s"]


def parse_args(argv: list[str] | None) -> SFTConfig:
    """The command line as a validated config (`--preset` picks the starting values)."""
    return pipeline_config(sft, load_sft_preset("debug_cpu"), argv, __doc__, PRESETS)


def main(argv: list[str] | None = None) -> DatasetResult:
    from flows.local_server import starting_prefect_server

    return run_pipeline(  # type: ignore[no-any-return]
        sft,
        load_sft_preset("debug_cpu"),
        argv,
        __doc__,
        PRESETS,
        SUMMARY_METRICS,
        server=starting_prefect_server,
        check=_check_files,
        deep_check=_check_names,
    )


def _check_names(config: SFTConfig) -> None:
    """Scheduler and LoRA target names, the memory estimate (a run that does not fit is
    refused) and the technique on the model built on the meta device, all before the server
    is up. The launch's agent, started now, runs them first (`sft_checks.check_ahead`, which
    imports torch and transformers' model classes), then imports the rest of the workload for
    the ranks (TRL, datasets, streaming): this process never imports them. Without an agent
    (TRAINFLOW_STANDBY=0, remote ranks) they run here."""
    ahead = _start_agent(config)
    for name in WHILE_WAITING:
        importlib.import_module(name)

    outcome = ahead.check_outcome()
    if outcome is None:
        from trainflow.workloads.sft_checks import check_ahead

        outcome = {"value": check_ahead(config.model_dump(mode="json"))}
    if "refused" in outcome:
        raise ValueError(outcome["refused"])
    if "failed" in outcome:
        raise RuntimeError(f"checking the config in the launch agent failed:\n{outcome['failed']}")
    found = outcome["value"]
    data = config.data_config()
    data_ahead.offer(data, functools.partial(ahead.outcome, data_ahead.prepare_call(data)))
    remember_shape(config.model, config.tokenizer_path(), found["shape"])
    for checked in found["checked"]:
        record_checked_ahead(SFT.name, SFTConfig.model_validate(checked))


if __name__ == "__main__":
    from trainflow.cli import exit_now

    main(sys.argv[1:])
    exit_now()  # the pipeline is done: skip only the interpreter's teardown
