"""Axolotl: prepare -> train with Axolotl's own config and entry point -> evaluate -> register.

Axolotl trains with its own YAML config and entry point (`axolotl.cli.train`), in
`.venvs/axolotl` (`bash scripts/setup-framework.sh axolotl`), on our ranks. With no config file
it runs `trainflow/presets/frameworks/axolotl-tiny.yaml`: a tiny Llama built here, the shipped
instruction data, 2 CPU ranks, a few minutes. `axolotl-olmo3-7b.yaml` is the Olmo 3 7B recipe
for 2 nodes of 8 H100s.

    python -m flows.axolotl
    python -m flows.axolotl --resume RUN_ID        # continue a stopped run (trains again)
    python -m flows.axolotl trainflow/presets/frameworks/axolotl-olmo3-7b.yaml \\
        --model allenai/Olmo-3-1025-7B --gpus 16 --nnodes 2 --gpu-type H100 --max-steps 1000

Usage: `python -m flows.axolotl CONFIG.yaml [options]`; `--help` lists the options.
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

AXOLOTL = PIPELINES["axolotl"]


@flow(name="axolotl", log_prints=True)
def axolotl(
    config: FrameworkConfig = AXOLOTL.defaults(), dry_run: bool = False
) -> DatasetResult | None:
    """Train with Axolotl on our ranks, evaluate on the held-out split, register in MLflow."""
    if dry_run:
        return plan_run(AXOLOTL, config)
    return frameworks.run_framework(FRAMEWORKS["axolotl"], config)


def main(argv: list[str] | None = None) -> DatasetResult:
    return command.main("axolotl", argv)  # type: ignore[no-any-return]


if __name__ == "__main__":
    command.run("axolotl")
