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

import sys

from prefect import flow

from flows import frameworks
from flows.skeleton import DatasetResult
from trainflow.configs.frameworks import FRAMEWORKS, FrameworkConfig

AXOLOTL = FRAMEWORKS["axolotl"]


@flow(name="axolotl", log_prints=True)
def axolotl(
    config: FrameworkConfig = frameworks.default_config(AXOLOTL),
) -> DatasetResult:
    """Train with Axolotl on our ranks, evaluate on the held-out split, register in MLflow."""
    return frameworks.run_framework(AXOLOTL, config)


def main(argv: list[str] | None = None) -> DatasetResult:
    return frameworks.main(axolotl, AXOLOTL, argv, __doc__)  # type: ignore[no-any-return]


if __name__ == "__main__":
    from trainflow.cli import exit_now

    main(sys.argv[1:])
    exit_now()  # the pipeline is done: skip only the interpreter's teardown
