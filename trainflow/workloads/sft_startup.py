"""The SFT pipeline's start-up: its checks, its launch agent started early, its memory plan.

`python -m flows.sft` spends most of its first seconds importing. These hooks
(`PipelineSpec.startup`) overlap that work: the training launch's agent starts before the flow's
module imports Prefect, checks the config with the model's libraries loaded
(`sft_checks.check_ahead`), prepares the dataset, and imports what the ranks need; this process
imports only what it needs itself meanwhile (MLflow's store, the loss plot's drawing).
"""

import functools
import importlib
from typing import Any

from trainflow import tracking
from trainflow.cli import start_launch_agent
from trainflow.configs.sft import SFTConfig
from trainflow.data import ahead as data_ahead
from trainflow.memory import MemoryPlan, plan_sft, remember_shape
from trainflow.workloads import record_checked_ahead

WORKLOAD = "trainflow.workloads.sft"
CHECKS = "trainflow.workloads.sft_checks"  # what the launch's agent checks first
# What this process needs once the run starts, imported while it waits for the agent's checks:
# the run's tracking (MLflow's store) and the loss plot's drawing.
WHILE_WAITING = (
    "mlflow",
    *tracking.SINK_IMPORTS,
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
)


def check_files(config: SFTConfig) -> None:
    """The data files' checks: they need no torch or transformers, so a bad row fails in
    about a second, before the Prefect server starts."""
    from trainflow.data.checks import check_files as check_data_files

    check_data_files(config.data_config())


def start_agent(config: SFTConfig) -> Any:
    """The training launch's agent, started now (or the one already started for `config`),
    asked to check `config` first (`sft_checks.check_ahead`), then to prepare its dataset,
    where `datasets`, `streaming` and the tokenizer are imported for the ranks anyway
    (`trainflow.data.ahead`: the prepare task waits for it), and DeepSpeed when the ranks use
    it (`trainflow.cli.TECHNIQUE_IMPORTS`)."""
    return start_launch_agent(
        config,
        WORKLOAD,
        check=(f"{CHECKS}:check_ahead", config.model_dump(mode="json")),
        then=[data_ahead.prepare_call(config.data_config())],
    )


def deep_check(config: SFTConfig) -> None:
    """Scheduler and LoRA target names, the memory estimate (a run that does not fit is
    refused) and the technique on the model built on the meta device, all before the server
    is up. The launch's agent, started now, runs them first (`sft_checks.check_ahead`, which
    imports torch and transformers' model classes), then imports the rest of the workload for
    the ranks (TRL, datasets, streaming): this process never imports them. Without an agent
    (TRAINFLOW_STANDBY=0, remote ranks) they run here."""
    ahead = start_agent(config)
    for name in WHILE_WAITING:
        importlib.import_module(name)
    tracking.open_store_ahead()

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
        record_checked_ahead("sft", SFTConfig.model_validate(checked))


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
