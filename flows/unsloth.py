"""Unsloth: prepare -> train with Unsloth's own config and entry point -> evaluate -> register.

Unsloth trains the way its users write it (`FastLanguageModel` + LoRA + TRL `SFTTrainer`,
DDP across GPUs), in `.venvs/unsloth` (`bash scripts/setup-framework.sh unsloth`), on our
ranks. Unsloth needs CUDA GPUs: on a machine without them the flow stops before anything starts
and says so. `unsloth-llama-3.2-3b.yaml` is the Llama 3.2 3B recipe for 8 A10s.

    python -m flows.unsloth trainflow/presets/frameworks/unsloth-llama-3.2-3b.yaml \\
        --model unsloth/Llama-3.2-3B-Instruct --gpus 8 --gpu-type A10

Usage: `python -m flows.unsloth [CONFIG.yaml] [options]`; `--help` lists the options.
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

UNSLOTH = PIPELINES["unsloth"]


@flow(name="unsloth", log_prints=True)
def unsloth(
    config: FrameworkConfig = UNSLOTH.defaults(), dry_run: bool = False
) -> DatasetResult | None:
    """Train with Unsloth on our ranks, evaluate on the held-out split, register in MLflow."""
    if dry_run:
        return plan_run(UNSLOTH, config)
    return frameworks.run_framework(FRAMEWORKS["unsloth"], config)


def main(argv: list[str] | None = None) -> DatasetResult:
    return command.main("unsloth", argv)  # type: ignore[no-any-return]


if __name__ == "__main__":
    command.run("unsloth")
