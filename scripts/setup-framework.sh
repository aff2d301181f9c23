#!/usr/bin/env bash
# Create the environment a training framework's ranks run in: .venvs/NAME.
#
#   bash scripts/setup-framework.sh axolotl       # Axolotl
#   bash scripts/setup-framework.sh llm-foundry   # Mosaic LLM Foundry + Composer (torch 2.7)
#   bash scripts/setup-framework.sh unsloth       # Unsloth
#   bash scripts/setup-framework.sh all           # all three at once (logs in .venvs/NAME.log)
#
# These frameworks pin torch, transformers or trl to versions our main environment (.venv)
# cannot share, so each gets its own virtual environment from scripts/frameworks/NAME.txt.
# The pipeline itself (Prefect, MLflow, data preparation, evaluation) runs in .venv; only
# the ranks run here (`LaunchOptions.python`). trainflow is installed without its
# dependencies: the rank side needs only torch, psutil and cloudpickle, listed in each file.
# Where .venv exists, the distributions a framework environment shares with it at the same
# version (Unsloth's torch and CUDA libraries, 5.4 GiB) are hard links to .venv's files, not
# copies (scripts/share_packages.py): the four environments take about 18 GB, not 26. Started
# by scripts/setup.sh --with-frameworks, they install beside .venv: one that pins .venv's torch
# waits for .venv first, the others link what they share once .venv is complete.
# Running it again on an existing environment only checks it (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."

known="$(cd scripts/frameworks && ls -1 *.txt | sed 's/\.txt$//' | paste -sd' ')"
name="${1:-}"

if [[ "$name" == "all" ]]; then
    mkdir -p .venvs
    declare -A pids
    for each in $known; do
        bash "$0" "$each" > ".venvs/$each.log" 2>&1 &
        pids[$each]=$!
    done
    failed=0
    for each in $known; do
        if wait "${pids[$each]}"; then
            tail -n 1 ".venvs/$each.log"
        else
            echo "setting up $each failed; the end of .venvs/$each.log:" >&2
            tail -n 20 ".venvs/$each.log" >&2
            failed=1
        fi
    done
    exit $failed
fi

if [[ -z "$name" || ! -f "scripts/frameworks/$name.txt" ]]; then
    echo "usage: bash scripts/setup-framework.sh NAME   (NAME one of: $known, or all)" >&2
    exit 2
fi
venv=".venvs/$name"
if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv"
fi
case "$name" in
    llm-foundry)
        # LLM Foundry pins torch 2.7.0, older than the torch this machine may cap pip at:
        # this one install ignores that cap (the main environment keeps it). pip skips an
        # empty PIP_CONSTRAINT and falls back to the config file's; an empty file overrides it.
        export PIP_CONSTRAINT=/dev/null
        ;;
esac
requirements="scripts/frameworks/$name.txt"
# Started by scripts/setup.sh while it installs .venv (TRAINFLOW_SETUP_PID): .venv is
# complete once it writes .venv/.trainflow-installed. Run alone, an existing .venv is.
venv_complete() {
    if [[ -n "${TRAINFLOW_SETUP_PID:-}" ]]; then
        [[ -e .venv/.trainflow-installed ]]
    else
        [[ -x .venv/bin/python ]]
    fi
}
wait_for_venv() {
    until venv_complete; do
        if ! kill -0 "$TRAINFLOW_SETUP_PID" 2>/dev/null; then
            echo "scripts/setup.sh stopped before .venv was complete" >&2
            exit 1
        fi
        sleep 2
    done
}
venv_torch="$(sed -n 's/^torch==//p' constraints.txt)"
if [[ -n "${TRAINFLOW_SETUP_PID:-}" ]] && grep -qx "torch==$venv_torch" "$requirements"; then
    echo "$name pins .venv's torch $venv_torch: waiting for .venv, to link it rather than copy it"
    wait_for_venv
fi
if venv_complete; then
    # What it pins at .venv's version is linked from .venv, not copied (see the script).
    .venv/bin/python scripts/share_packages.py seed "$venv" "$requirements"
fi
echo "Installing $name into $venv ($requirements)"
"$venv/bin/pip" install --quiet --progress-bar off -r "$requirements"
"$venv/bin/pip" install --quiet --progress-bar off --no-deps -e .
if [[ -n "${TRAINFLOW_SETUP_PID:-}" ]]; then
    wait_for_venv
fi
if venv_complete; then
    .venv/bin/python scripts/share_packages.py link "$venv"
fi
"$venv/bin/python" -c "import trainflow.launch.agent, trainflow.launch.worker" \
    || { echo "$venv cannot import trainflow's rank side" >&2; exit 1; }
echo "$name ready: $venv/bin/python"
