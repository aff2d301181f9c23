"""Serve every deployment in prefect.yaml from this process, schedules included.

The zero-infrastructure way to run deployments: no work pool or worker needed. Runs started
from the UI or on a schedule execute here.

    prefect server start &        # or any PREFECT_API_URL
    python -m deployments.serve
"""

import argparse

from prefect import serve
from prefect.schedules import Cron

from deployments.catalog import deployments


def runner_deployments(only: set[str] | None = None) -> list:
    """Build a served deployment for each prefect.yaml entry (optionally only some names)."""
    built = []
    for entry in deployments():
        if only and entry.full_name not in only:
            continue
        built.append(
            entry.load_flow().to_deployment(
                name=entry.name,
                parameters=entry.parameters,
                description=entry.description,
                tags=entry.tags,
                schedules=[
                    Cron(s["cron"], timezone=s.get("timezone"), active=s.get("active", True))
                    for s in entry.schedules
                ],
            )
        )
    return built


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("names", nargs="*", help="Only these deployments (flow/name); default all.")
    args = parser.parse_args(argv)
    serve(*runner_deployments(set(args.names) or None))


if __name__ == "__main__":
    main()
