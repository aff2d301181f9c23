"""`python -m trainflow runs`: the pipelines' MLflow runs, newest first.

    python -m trainflow runs                      # every experiment in the store
    python -m trainflow runs --experiment sft --status FAILED
    python -m trainflow runs --help

Like every command that opens the tracking store, it first marks FAILED the runs left RUNNING
by a process of this machine that has died (SIGKILL, out of memory), with the reason in the
run's `trainflow.failure_reason` tag (`trainflow.tracking.reap_dead_runs`).
"""

import argparse
import sys
from datetime import datetime

STATUSES = ("RUNNING", "FINISHED", "FAILED", "KILLED", "SCHEDULED")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainflow",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    runs = commands.add_parser(
        "runs",
        help="List the MLflow runs (after marking FAILED those whose process died here).",
        description="List the MLflow runs of the store ($MLFLOW_TRACKING_URI, else "
        "sqlite:///mlflow.db), newest first. Runs left RUNNING by a process of this machine "
        "that has died are marked FAILED first, with the reason.",
    )
    runs.add_argument("--experiment", metavar="NAME", help="Only this experiment's runs.")
    runs.add_argument("--status", choices=STATUSES, help="Only runs with this status.")
    runs.add_argument(
        "--limit", type=int, default=50, metavar="N", help="Show at most N runs (default: 50)."
    )
    return parser


def runs(experiment: str | None, status: str | None, limit: int) -> int:
    """Print the store's runs, newest first; the exit status."""
    from trainflow import tracking

    for run_id in tracking.reap_dead_runs():
        print(f"marked FAILED: MLflow run {run_id} (its process died)", file=sys.stderr)
    rows = tracking.list_runs(experiment, status, limit)
    if rows is None:
        print(f"python -m trainflow runs: error: no experiment {experiment!r}", file=sys.stderr)
        return 2
    print(f"{'run id':<32}  {'experiment':<14}  {'status':<8}  {'started':<19}  name / reason")
    for row in rows:
        started = datetime.fromtimestamp(row.start_time / 1000).strftime("%Y-%m-%d %H:%M:%S")
        note = row.name + (f" ({row.reason})" if row.reason else "")
        print(f"{row.run_id:<32}  {row.experiment:<14}  {row.status:<8}  {started:<19}  {note}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return runs(args.experiment, args.status, args.limit)


if __name__ == "__main__":
    raise SystemExit(main())
