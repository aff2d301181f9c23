"""Supervised fine-tuning of a causal LM: prepare -> train -> evaluate -> register.

The `debug_cpu` preset (default) fine-tunes a tiny Llama on the shipped instruction data with
DDP on 2 CPU ranks in a few minutes. Run locally (local Prefect, SQLite MLflow store
`mlflow.db`)::

    python -m flows.sft
    python -m flows.sft --technique fsdp --max-steps 50 --lora
    python -m flows.sft --preset h100          # Llama-3.2-1B-Instruct on trl-lib/Capybara
    python -m flows.sft --model meta-llama/Llama-3.2-1B-Instruct --dataset trl-lib/Capybara \\
        --gpus 8 --gpu-type H100 --technique deepspeed
    python -m flows.sft --help

Deploy: `prefect --no-prompt deploy --name sft/cpu-local` (see prefect.yaml).
"""

import functools
import sys

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from flows.techniques import techniques
from tasks.data import prepare_dataset
from tasks.reporting import publish_summary
from tasks.sft import evaluate_sft, publish_loss_curve, register_sft_model, training_progress
from tasks.tracking import log_metrics
from trainflow.cli import parse_config, print_summary
from trainflow.paths import trainflow_home
from trainflow.strategies.job import Workload
from trainflow.tracking import pipeline_run, tracking_uri
from trainflow.workloads import sft as workload


class SFTResult(BaseModel):
    """What a pipeline run produced."""

    mlflow_run_id: str = Field(description="MLflow run holding params, metrics and the model.")
    technique: str = Field(description="Technique that trained the model.")
    registered_model_name: str = Field(description="MLflow registered model name.")
    model_version: str = Field(description="Registered model version.")
    champion: bool = Field(description="Whether the version passed the gate and got the alias.")
    dataset_uri: str = Field(description="Prepared dataset the model was trained on.")
    prefect_flow_run_id: str = Field(description="This pipeline's Prefect flow run.")
    metrics: dict[str, float] = Field(description="Training and held-out metrics, before/after.")
    tracking_uri: str = Field(description="MLflow store the run was logged to.")


@flow(name="sft", log_prints=True)
def sft(config: workload.SFTConfig = workload.load_sft_preset("debug_cpu")) -> SFTResult:
    """Fine-tune a causal LM: prepare -> train -> evaluate -> register (alias past the gate)."""
    data = prepare_dataset(config.data_config())
    technique = config.technique.name
    lineage = {
        "dataset_uri": data.uri,
        "dataset_fingerprint": data.fingerprint,
        "technique": technique,
        "base_model": config.model,
        "lora": str(config.lora).lower(),
        "prefect_flow_run_id": str(flow_run.get_id()),
        "code_version": workload.code_version(),
    }
    with pipeline_run(
        config.experiment_name,
        run_name=f"sft-{technique}-{flow_run.get_name() or 'local'}",
        params=config.model_dump(),
        tags=lineage,
    ) as run_id:
        output_dir = str(trainflow_home() / "outputs" / "sft" / run_id)
        with training_progress(output_dir):
            trained = techniques[technique](
                workload=Workload(
                    train_fn=workload.train,
                    model_fn=workload.build_model,
                    config=workload.SFTJob(config=config, data=data),
                    output_dir=output_dir,
                    mlflow_run_id=run_id,
                ),
                technique=config.technique,
                resources=config.resources(),
            )
        publish_loss_curve(run_id, trained.history, output_dir)
        report = evaluate_sft(config, data, output_dir)
        log_metrics(run_id, report)
        failures = workload.gate_failures(config.evaluation, report)
        for failure in failures:
            print(f"gate not passed, no champion alias: {failure}")
        version = register_sft_model(
            run_id,
            config,
            data,
            output_dir,
            lineage | {"mlflow_run_id": run_id, "world_size": str(trained.world_size)},
            champion=not failures,
        )
    metrics = trained.metrics | report
    publish_summary(
        "sft-summary",
        title="SFT pipeline",
        config=config.model_dump(),
        metrics=metrics,
        model=f"{config.registered_model_name} v{version}"
        + (" (champion)" if not failures else " (gate not passed: no alias)"),
        mlflow_run_id=run_id,
    )
    return SFTResult(
        mlflow_run_id=run_id,
        technique=technique,
        registered_model_name=config.registered_model_name,
        model_version=version,
        champion=not failures,
        dataset_uri=data.uri,
        prefect_flow_run_id=lineage["prefect_flow_run_id"],
        metrics=metrics,
        tracking_uri=tracking_uri(),
    )


SUMMARY_METRICS = [
    f"{when}_{name}"
    for name in ("loss", "perplexity", "exact_match")
    for when in ("untrained", "eval")
] + ["train_runtime", "train_tokens_per_s"]


def parse_args(argv: list[str] | None) -> workload.SFTConfig:
    """The command line as a validated config (`--preset` picks the starting values)."""
    return parse_config(
        workload.SFTConfig,
        workload.load_sft_preset("debug_cpu"),
        argv,
        prog="python -m flows.sft",
        description=__doc__ or "",
        presets={
            name: functools.partial(workload.load_sft_preset, name)
            for name in workload.sft_preset_names()
        },
    )


def main(argv: list[str] | None = None) -> SFTResult:
    result = sft(parse_args(argv))
    alias = "champion" if result.champion else "no alias (gate not passed)"
    print_summary(
        "sft pipeline finished",
        {
            "MLflow store": result.tracking_uri,
            "MLflow run": result.mlflow_run_id,
            "Technique": result.technique,
            "Model": f"{result.registered_model_name} version {result.model_version}, {alias}",
        },
        {k: result.metrics[k] for k in SUMMARY_METRICS if k in result.metrics},
    )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
