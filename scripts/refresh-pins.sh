#!/usr/bin/env bash
# Refresh constraints.txt: resolve the newest releases that pyproject.toml's ranges allow, in a
# new environment, pin them, and run the tests on them.
#
#   bash scripts/refresh-pins.sh            # resolve, pin, reinstall .venv, run the tests
#   bash scripts/refresh-pins.sh --no-tests # resolve and pin only
#
# torch and torchvision stay at pyproject.toml's exact versions. The new pins replace
# constraints.txt only once the resolve succeeded (the old file is kept as
# constraints.txt.previous); `git diff constraints.txt` shows what moved. When the tests fail
# on the new set, narrow the offending range in pyproject.toml (or fix the code) and run this
# again. The framework environments (scripts/frameworks/*.txt) follow their frameworks' own
# pins and are moved by hand: docs/frameworks.md says what holds each one back.
set -euo pipefail
cd "$(dirname "$0")/.."

run_tests=1
for arg in "$@"; do
    case "$arg" in
        --no-tests) run_tests=0 ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option $arg (use --no-tests)" >&2; exit 2 ;;
    esac
done

work="$(mktemp -d "${TMPDIR:-/tmp}/trainflow-pins.XXXXXX")"
trap 'rm -rf "$work"' EXIT

echo "Resolving the newest releases within pyproject.toml's ranges (a few minutes)"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --progress-bar off --upgrade pip
# DeepSpeed compiles no ops at install; the CPU paths use torch's own Adam.
# Editable, so nothing is built in the checkout (a plain install leaves build/ behind).
DS_BUILD_OPS=0 "$work/venv/bin/pip" install --quiet --progress-bar off -e ".[dev,ray,k8s,team]"

{
    "$work/venv/bin/pip" freeze --exclude-editable | grep -v -i '^trainflow[= @]' | grep -v '^pip=='
} > "$work/constraints.txt"

if ! grep -q '^torch==' "$work/constraints.txt"; then
    echo "the resolved set has no torch pin; constraints.txt left as it was" >&2
    exit 1
fi
if [[ -f constraints.txt ]]; then
    cp constraints.txt constraints.txt.previous
fi
cp "$work/constraints.txt" constraints.txt
echo "constraints.txt: $(wc -l < constraints.txt) pins; what moved:"
git --no-pager diff --stat -- constraints.txt || true
git --no-pager diff -U0 -- constraints.txt | grep '^[-+][A-Za-z]' | sort -t= -k1,1 -s || true

if [[ "$run_tests" == 1 ]]; then
    echo "Reinstalling .venv on the new pins and running the tests"
    rm -rf .venv
    # The README's test command (.ci/run).
    bash scripts/setup.sh --with-frameworks --with-browser && .venv/bin/python -m pytest
fi
