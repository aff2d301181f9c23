"""LLM Foundry: prepare -> train with its own config and entry point -> evaluate -> register.

LLM Foundry trains with its own YAML and entry point (`llmfoundry.command_utils.train_from_yaml`,
what `composer scripts/train/train.py` runs), in `.venvs/llm-foundry`
(`bash scripts/setup-framework.sh llm-foundry`), on our ranks, reading the MDS shards our data
task prepares. With no config file it runs `trainflow/presets/frameworks/llm-foundry-tiny.yaml`
(a tiny Llama, the shipped instruction data, 2 CPU ranks). `llm-foundry-llama-3-8b.yaml` is the
Llama 3 8B fine-tuning recipe for 8 GPUs with FSDP.

    python -m flows.llm_foundry
    python -m flows.llm_foundry trainflow/presets/frameworks/llm-foundry-llama-3-8b.yaml \\
        --model meta-llama/Meta-Llama-3-8B --gpus 8 --gpu-type H100 --max-steps 1000

Usage: `python -m flows.llm_foundry CONFIG.yaml [options]`; `--help` lists the options.
The pipeline fills in the base model, the data, the output folder and `--max-steps` in the
config; the rest is the file's.
See docs/frameworks.md for what is tested where.
"""

from prefect import flow

from flows import command, frameworks
from flows.skeleton import DatasetResult
from tasks.plan import plan_run
from trainflow.configs.frameworks import FRAMEWORKS, FrameworkConfig
from trainflow.pipelines import PIPELINES

LLM_FOUNDRY = PIPELINES["llm_foundry"]


@flow(name="llm_foundry", log_prints=True)
def llm_foundry(
    config: FrameworkConfig = LLM_FOUNDRY.defaults(), dry_run: bool = False
) -> DatasetResult | None:
    """Train with LLM Foundry on our ranks, evaluate on the held-out split, register in MLflow."""
    if dry_run:
        return plan_run(LLM_FOUNDRY, config)
    return frameworks.run_framework(FRAMEWORKS["llm-foundry"], config)


def main(argv: list[str] | None = None) -> DatasetResult:
    return command.main("llm_foundry", argv)  # type: ignore[no-any-return]


if __name__ == "__main__":
    command.run("llm_foundry")
