#!/usr/bin/env bash
# Create the environment a training framework's ranks run in: .venvs/NAME.
#
#   bash scripts/setup-framework.sh axolotl       # Axolotl (its own transformers/trl pins)
#   bash scripts/setup-framework.sh llm-foundry   # Mosaic LLM Foundry + Composer (torch 2.7)
#   bash scripts/setup-framework.sh unsloth       # Unsloth (needs a CUDA GPU to train)
#
# These frameworks pin torch, transformers or trl to versions our main environment (.venv)
# cannot share, so each gets its own virtual environment from scripts/frameworks/NAME.txt.
# The pipeline itself (Prefect, MLflow, data preparation, evaluation) runs in .venv; only
# the ranks run here (`LaunchOptions.python`). trainflow is installed without its
# dependencies: the rank side needs only torch, psutil and cloudpickle, listed in each file.
set -euo pipefail
cd "$(dirname "$0")/.."

name="${1:-}"
known="$(cd scripts/frameworks && ls -1 *.txt 2>/dev/null | sed 's/\.txt$//' | paste -sd' ')"
if [[ -z "$name" || ! -f "scripts/frameworks/$name.txt" ]]; then
    echo "usage: bash scripts/setup-framework.sh NAME   (NAME one of: $known)" >&2
    exit 2
fi
venv=".venvs/$name"
if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv"
fi
extra=()
case "$name" in
    llm-foundry)
        # LLM Foundry pins torch 2.7.0, older than the torch this machine may cap pip at:
        # this one install ignores that cap (the main environment keeps it). pip skips an
        # empty PIP_CONSTRAINT and falls back to the config file's; an empty file overrides it.
        export PIP_CONSTRAINT=/dev/null
        ;;
esac
echo "Installing $name into $venv (scripts/frameworks/$name.txt)"
"$venv/bin/pip" install --quiet --progress-bar off ${extra[@]+"${extra[@]}"} -r "scripts/frameworks/$name.txt"
"$venv/bin/pip" install --quiet --progress-bar off --no-deps -e .
"$venv/bin/python" -c "import trainflow._agent, trainflow._worker" \
    || { echo "$venv cannot import trainflow's rank side" >&2; exit 1; }
echo "$name ready: $venv/bin/python"
