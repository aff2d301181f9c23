#!/usr/bin/env bash
# The GPU acceptance run (docs/gpu.md) on a machine with a CUDA GPU and this checkout, with the
# packages installed there (it needs no package index); about 6 minutes on one H100 or H200:
#
#   bash scripts/gpu-check.sh [--out DIR] [--parts a,b]   # also writes the results into docs/gpu.md
#   bash scripts/gpu-check.sh --dry [--out DIR]           # toy sizes on the CPU; docs untouched
#
# The arguments go to `python -m benchmarks.gpu_acceptance` (see its --help; a first argument
# that is not an option is the output folder, default test-output/gpu-check). It prints one line
# per part, a markdown table, and one JSON object on the last line; the exit status is 1 if a
# part failed. PYTHON picks the interpreter (default: python).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python}
if [[ $# -gt 0 && $1 != -* ]]; then
    set -- --out "$1" "${@:2}"
fi
docs=(--write-docs "$repo/docs/gpu.md")
for arg in "$@"; do
    case $arg in --dry | --write-docs | --write-docs=* | -h | --help) docs=() ;; esac
done
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m benchmarks.gpu_acceptance \
    ${docs[@]+"${docs[@]}"} "$@"
