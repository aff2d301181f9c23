"""Prefect flows, one pipeline per module: `python -m flows.<name>`."""

import os

# Pipelines run offline by default: the local Prefect server sends no usage telemetry unless
# the user opts in.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
