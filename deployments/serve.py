"""Serve every pipeline in prefect.yaml from this process, schedules included.

The zero-infrastructure way to get deployments: no work pool or worker needed.

    prefect server start &        # or any PREFECT_API_URL
    python -m deployments.serve
"""

from prefect import serve

from deployments.catalog import deployments


def main() -> None:
    runnable = [
        entry.load_flow().to_deployment(
            name=entry.name,
            parameters=entry.parameters,
            description=entry.description,
            cron=entry.cron,
        )
        for entry in deployments()
    ]
    serve(*runnable)


if __name__ == "__main__":
    main()
