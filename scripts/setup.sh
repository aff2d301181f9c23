#!/usr/bin/env bash
# Set up a development environment in .venv: pinned dependencies and trainflow itself.
#
#   bash scripts/setup.sh                 # Python packages only
#   bash scripts/setup.sh --with-browser  # also Debian's Chromium, for the UI browser test
#   bash scripts/setup.sh --with-stack    # also Debian's PostgreSQL, for `deployments.stack`
#   bash scripts/setup.sh --with-frameworks --with-browser --with-stack  # also .venvs/ of
#                                         # Axolotl, LLM Foundry and Unsloth
#                                         # (scripts/setup-framework.sh all)
set -euo pipefail
cd "$(dirname "$0")/.."

with_browser=0
with_frameworks=0
with_stack=0
frameworks_pid=""
for arg in "$@"; do
    case "$arg" in
        --with-browser) with_browser=1 ;;
        --with-frameworks) with_frameworks=1 ;;
        --with-stack) with_stack=1 ;;
        *) echo "unknown option $arg (use --with-browser, --with-frameworks, --with-stack)" >&2
           exit 2 ;;
    esac
done

# Marks .venv complete: the framework environments link what they share with it only then.
installed=.venv/.trainflow-installed
rm -f "$installed"

if [[ "$with_frameworks" == 1 ]]; then
    # Their own environments (minutes, GBs) install while .venv's does. Those that pin .venv's
    # torch (Unsloth: torch and its CUDA libraries, 5.4 GiB) wait for it and link it rather than
    # copy it; the others start now and link what they share once .venv is complete
    # (scripts/share_packages.py). Their own process group: stopped with this script.
    echo "Disk free for the framework environments: $(df -h --output=avail . | tail -n 1 | tr -d ' ')"
    TRAINFLOW_SETUP_PID=$$ setsid -w bash scripts/setup-framework.sh all > .venvs-setup.log 2>&1 &
    frameworks_pid=$!
    trap 'kill -- -"$frameworks_pid" 2>/dev/null || true' EXIT
fi

if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
fi
# A .venv from before the move to streaming-community has mosaicml-streaming, which installs
# the same `streaming` package: remove both, and the install below puts the fork back whole.
if .venv/bin/pip show --quiet mosaicml-streaming 2>/dev/null; then
    .venv/bin/pip uninstall --quiet --yes mosaicml-streaming streaming-community
fi
# DeepSpeed compiles no ops at install; the CPU paths use torch's own Adam.
DS_BUILD_OPS=0 .venv/bin/pip install --quiet --progress-bar off -c constraints.txt -e ".[dev,ray,k8s,team]"
# A temporary Prefect server on a new home starts on a copy of this migrated empty database
# instead of migrating its own (about 6 s of a first run's start on 2 cores); MLflow's map of
# installed packages is built here once rather than by a first run's launch (0.7 s).
.venv/bin/python -m flows.local_server make-template
touch "$installed"
echo "Python packages installed in .venv"

if [[ "$with_browser" == 1 ]]; then
    if [[ -x /usr/bin/chromium ]]; then
        echo "Chromium present: $(/usr/bin/chromium --version 2>/dev/null || true)"
    elif [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null; then
        echo "Installing Debian's chromium for the browser test (about a minute)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "Chromium not installed and cannot install it here (needs root and apt-get):"
        echo "the browser test will be skipped with that reason."
    fi
fi

if [[ "$with_stack" == 1 ]]; then
    if compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null; then
        echo "PostgreSQL present: $(ls /usr/lib/postgresql | sort -n | tail -n 1)"
    elif [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null; then
        echo "Installing Debian's postgresql for the team stack and its tests (about a minute)"
        apt-get update -qq
        # The package's own cluster is not started: the stack runs a private one.
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    else
        echo "PostgreSQL not installed and cannot install it here (needs root and apt-get):"
        echo "the team stack tests will be skipped with that reason."
    fi
fi

if [[ -n "$frameworks_pid" ]]; then
    echo "Waiting for the framework environments (.venvs/NAME.log)"
    if ! wait "$frameworks_pid"; then
        cat .venvs-setup.log >&2
        exit 1
    fi
    cat .venvs-setup.log
fi
