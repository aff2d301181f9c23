"""A team's load at once: a sweep of MLP trials under a rank budget, SFT runs and a two-tower run,
all started together, against the team stack (PostgreSQL under the Prefect and MLflow servers,
datasets in the object store) and, side by side, against the embedded defaults (each process's
own temporary Prefect server on SQLite, one shared MLflow SQLite file, local datasets).

    python -m benchmarks.stack_load                       # both, the issue's load
    python -m benchmarks.stack_load --target stack --trials 4 --budget 2 --sft 1   # smaller

Each side runs in a temporary folder of its own; the stack side starts its own stack there with
`python -m deployments.stack up` and ends it with `down --purge`. The checks:

- every process exits 0; every MLflow run ends FINISHED; every pipeline run registered a model
  version; every trial's run is a child of the sweep's run (`mlflow.parentRunId`);
- on the stack, the Prefect API lists every flow run (the sweep, each trial, each run), all
  COMPLETED (the embedded side has no shared Prefect server to ask);
- database errors (`database is locked`, deadlocks, unique-key errors a client saw, failed
  connections) counted in every process's output and every server's log, PostgreSQL's too;
  inserts PostgreSQL refused on a unique key that the servers handled themselves are counted
  apart, by constraint (`postgres_unique_violations`).

The last line of stdout is one JSON object with each side's counts and wall time, and
`stack_over_sqlite`, the ratio of the wall times. A process that exits non-zero has the last
`LOG_TAIL` lines of its output printed on stderr (`--keep` keeps the whole logs).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from deployments.stack_services import cluster_home

REPO = Path(__file__).resolve().parents[1]
DB_ERRORS = re.compile(
    r"database is locked|deadlock detected|UniqueViolation|IntegrityError"
    r"|could not serialize access|too many (?:clients|connections)|connection refused",
    re.IGNORECASE,
)
LOG_TAIL = 60  # lines of a failed process's output shown on stderr


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The load: one sweep, `--sft` SFT runs and `--two-tower` two-tower runs."""
    space = json.dumps({"learning_rate": {"log_uniform": [1e-4, 1e-2]}})
    base = json.dumps({"max_steps": args.mlp_steps})
    load = {
        "sweep": [
            *("flows.sweep", "mlp", "--trials", str(args.trials), "--budget", str(args.budget)),
            *("--space", space, "--base", base),
        ]
    }
    for i in range(args.sft):
        load[f"sft-{i}"] = ["flows.sft", "--max-steps", str(args.sft_steps)]
    for i in range(args.two_tower):
        load[f"two_tower-{i}"] = [
            "flows.two_tower",
            *("--training-max-steps", str(args.two_tower_steps)),
        ]
    return load


def run_load(env: dict[str, str], work: Path, load: dict[str, list[str]]) -> dict[str, Any]:
    """Start every command at once; wait for all; their exit codes, outputs and the wall time."""
    started = time.monotonic()
    procs = {}
    for name, argv in load.items():
        out = open(work / f"{name}.log", "wb")  # noqa: SIM115 - closed below
        procs[name] = (
            subprocess.Popen(
                [sys.executable, "-m", *argv],
                cwd=work,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            ),
            out,
        )
    codes = {}
    for name, (proc, out) in procs.items():
        codes[name] = proc.wait()
        out.close()
        print(f"  {name}: exit {codes[name]} at {time.monotonic() - started:.0f}s", file=sys.stderr)
    for name, code in codes.items():
        if code != 0:  # the work folder goes at the end: keep why it failed where it is read
            tail = (work / f"{name}.log").read_text(errors="replace").splitlines()[-LOG_TAIL:]
            print(f"--- the last lines of {name}'s output ---", *tail, sep="\n", file=sys.stderr)
    return {"exit_codes": codes, "wall_s": round(time.monotonic() - started, 1)}


def mlflow_checks(tracking_uri: str, trials: int) -> dict[str, Any]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, max_results=1000)
    statuses: dict[str, int] = {}
    for run in runs:
        statuses[run.info.status] = statuses.get(run.info.status, 0) + 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    parents = {r.data.tags["mlflow.parentRunId"] for r in children}
    # One sweep run, every trial its child, and that parent is a run of this store.
    linked = len(parents) == 1 and parents <= {r.info.run_id for r in runs}
    pipeline_runs = [r for r in runs if r.info.run_id not in parents]
    versions = client.search_model_versions(max_results=1000)
    with_version = {v.run_id for v in versions}
    return {
        "mlflow_runs": len(runs),
        "mlflow_statuses": statuses,
        "sweep_children": len(children),
        "children_linked": linked and len(children) == trials,
        "versions": len(versions),
        "pipeline_runs_without_version": sum(
            r.info.run_id not in with_version for r in pipeline_runs
        ),
    }


def prefect_checks(api_url: str, trials: int) -> dict[str, Any]:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def read() -> list:
        runs: list = []
        async with get_client() as client:
            while page := await client.read_flow_runs(limit=200, offset=len(runs)):
                runs += page
        return runs

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        flow_runs = asyncio.run(read())
    states: dict[str, int] = {}
    for run in flow_runs:
        key = run.state_type.value if run.state_type else "NONE"
        states[key] = states.get(key, 0) + 1
    names = {run.name for run in flow_runs}
    return {
        "flow_runs": len(flow_runs),
        "flow_run_states": states,
        "every_trial_listed": all(f"trial-{i}" in names for i in range(trials)),
    }


def count_db_errors(paths: list[Path]) -> dict[str, int]:
    """Database errors that reached a process: in each run's output and each server's log, by
    file and kind."""
    counts: dict[str, int] = {}
    for path in paths:
        if not path.is_file():
            continue
        for found in DB_ERRORS.findall(path.read_text(errors="replace")):
            key = f"{path.name}: {found.lower()}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def postgres_unique_violations(path: Path) -> dict[str, int]:
    """Inserts PostgreSQL refused on a unique key, by constraint, as its log names them. The
    servers catch these (MLflow's log_model sends the run's metrics again to link them to the
    logged model; Prefect records a task run from its client and from its events), so no client
    sees them; they are counted apart from `db_errors`."""
    counts: dict[str, int] = {}
    if path.is_file():
        for name in re.findall(r'violates unique constraint "(\w+)"', path.read_text()):
            counts[name] = counts.get(name, 0) + 1
    return counts


def stack_side(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env["TRAINFLOW_STACK_DIR"] = str(work / "stack")
    env.pop("TRAINFLOW_STACK_ARTIFACTS", None)

    def stack(verb: str, *more: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "deployments.stack", verb, *more],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"stack {verb} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    stack("up")
    try:
        for line in stack("env").splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value
        env["TRAINFLOW_HOME"] = str(work / "home")
        env["PYTHONPATH"] = str(REPO)
        result = run_load(env, work, commands(args))
        result.update(mlflow_checks(env["MLFLOW_TRACKING_URI"], args.trials))
        result.update(prefect_checks(env["PREFECT_API_URL"], args.trials))
        logs = [*work.glob("*.log"), *(work / "stack" / "logs").glob("*.log")]
        postgres_log = cluster_home(work / "stack") / "server.log"
        logs.append(postgres_log)  # deadlocks and lock timeouts show here
        result["db_errors"] = count_db_errors(logs)
        result["postgres_unique_violations"] = postgres_unique_violations(postgres_log)
        return result
    finally:
        stack("down", "--purge")


def sqlite_side(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.pop("TRAINFLOW_DATASETS", None)
    env["TRAINFLOW_HOME"] = str(work / "home")
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    env["PYTHONPATH"] = str(REPO)
    result = run_load(env, work, commands(args))
    result.update(mlflow_checks(env["MLFLOW_TRACKING_URI"], args.trials))
    result["db_errors"] = count_db_errors(list(work.glob("*.log")))
    return result


def verdict(side: dict[str, Any], processes: int) -> bool:
    statuses = side["mlflow_statuses"]
    ok = all(code == 0 for code in side["exit_codes"].values())
    ok &= set(statuses) == {"FINISHED"} and side["children_linked"]
    ok &= side["pipeline_runs_without_version"] == 0 and not side["db_errors"]
    if "flow_run_states" in side:
        ok &= set(side["flow_run_states"]) == {"COMPLETED"} and side["every_trial_listed"]
    return bool(ok) and len(side["exit_codes"]) == processes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", choices=["both", "stack", "sqlite"], default="both")
    parser.add_argument("--trials", type=int, default=8, help="MLP trials of the sweep.")
    parser.add_argument("--budget", type=int, default=4, help="The sweep's rank budget.")
    parser.add_argument("--sft", type=int, default=2, help="SFT runs beside the sweep.")
    parser.add_argument("--two-tower", type=int, default=1, help="Two-tower runs beside it.")
    parser.add_argument("--mlp-steps", type=int, default=30, help="Steps of each MLP trial.")
    parser.add_argument("--sft-steps", type=int, default=10, help="Steps of each SFT run.")
    parser.add_argument("--two-tower-steps", type=int, default=20, help="Two-tower steps.")
    parser.add_argument("--keep", action="store_true", help="Keep the work folder (logs).")
    args = parser.parse_args(argv)
    processes = 1 + args.sft + args.two_tower
    report: dict[str, Any] = {
        "benchmark": "stack_load",
        "trials": args.trials,
        "budget": args.budget,
        "sft": args.sft,
        "two_tower": args.two_tower,
    }
    work = Path(tempfile.mkdtemp(prefix="trainflow-load-"))
    try:
        for target, side in (("stack", stack_side), ("sqlite", sqlite_side)):
            if args.target in (target, "both"):
                print(f"{target}: {processes} processes at once", file=sys.stderr)
                (work / target).mkdir()
                report[target] = side(args, work / target)
                report[target]["ok"] = verdict(report[target], processes)
        if "stack" in report and "sqlite" in report:
            report["stack_over_sqlite"] = round(
                report["stack"]["wall_s"] / report["sqlite"]["wall_s"], 2
            )
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report))
    sides = [report[t] for t in ("stack", "sqlite") if t in report]
    sys.exit(0 if all(s["ok"] for s in sides) else 1)


if __name__ == "__main__":
    main()
