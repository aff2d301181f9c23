"""Supervised fine-tuning of a causal LM: prepare -> train -> evaluate -> register.

The `debug_cpu` preset (default) fine-tunes a tiny Llama on the shipped instruction data with
DDP on 2 CPU ranks in a few minutes. Run locally (local Prefect, SQLite MLflow store
`mlflow.db`)::

    python -m flows.sft
    python -m flows.sft --technique fsdp --max-steps 50 --lora
    python -m flows.sft --preset h100          # Llama-3.2-1B-Instruct on trl-lib/Capybara
    python -m flows.sft --preset gpt-oss-20b   # also gpt-oss-120b, llama-3.2-1b-zero3
    python -m flows.sft --preset gpt-oss-120b --technique auto --dry-run   # plan it, anywhere
    python -m flows.sft --model meta-llama/Llama-3.2-1B-Instruct --dataset trl-lib/Capybara \\
        --gpus 8 --gpu-type H100 --technique deepspeed
    python -m flows.sft --help

Before launch the flow prints the memory estimate per GPU (`trainflow.memory`), refuses a run
that does not fit the GPUs, and resolves `--technique auto` to the technique that fits.

Deploy: `prefect --no-prompt deploy --name sft/cpu-local` (see prefect.yaml).
"""

from prefect import flow

from flows import command
from flows.skeleton import DatasetResult, evaluate, finish, preflight, register, tracked_run, train
from tasks.data import prepare_dataset
from tasks.plan import plan_run
from trainflow.configs.sft import SFTConfig, SFTJob
from trainflow.pipelines import PIPELINES
from trainflow.workloads.sft_startup import plan_memory, record_memory_plan

SFT = PIPELINES["sft"]


@flow(name="sft", log_prints=True)
def sft(config: SFTConfig = SFT.defaults(), dry_run: bool = False) -> DatasetResult | None:
    """Fine-tune a causal LM: prepare -> train -> evaluate -> register (alias past the gate)."""
    if dry_run:
        return plan_run(SFT, config)
    plan = plan_memory(config)  # refuses what does not fit; `auto` becomes a technique here
    config = config.with_technique(plan.technique)
    preflight(SFT.ranks, config)  # before the data is prepared, which can take long
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
    with tracked_run(SFT.ranks, config, lineage, job=job, checked=True) as run:
        record_memory_plan(run.run_id, plan)
        trained = train(run, config)
        evaluation = evaluate(run, trained)
        registration = register(run, config, evaluation, trained)
    return finish(
        run, config, trained, evaluation, registration, DatasetResult, dataset_uri=data.uri
    )


def main(argv: list[str] | None = None) -> DatasetResult:
    return command.main("sft", argv)  # type: ignore[no-any-return]


if __name__ == "__main__":
    command.run("sft")
