"""Run summaries as Prefect artifacts: what a person opens the UI to see."""

import base64
import io
from collections.abc import Mapping
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from trainflow.tracking import flatten_params, tracking_uri


def figure_markdown(figure: Any, alt: str) -> str:
    """A matplotlib figure as an inline PNG image in markdown (artifacts hold no files)."""
    png = io.BytesIO()
    figure.savefig(png, format="png")
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png.getvalue()).decode()})"


def _table(rows: Mapping[str, Any]) -> str:
    lines = ["| name | value |", "|---|---|"]
    for key, value in rows.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"| {key} | `{shown}` |")
    return "\n".join(lines)


@task(name="publish-summary", cache_policy=NO_CACHE)
def publish_summary(
    key: str,
    title: str,
    config: Mapping[str, Any],
    metrics: Mapping[str, float],
    model: str,
    mlflow_run_id: str,
) -> str:
    """Create the run's markdown summary artifact (config, metrics, model); returns its id.

    A nested config is shown flat, one `section.field` row per value, as in MLflow's params.
    """
    markdown = (
        f"# {title}\n\n**Model:** {model}  \n**MLflow run:** `{mlflow_run_id}` "
        f"in `{tracking_uri()}`\n\n## Metrics\n\n{_table(metrics)}\n\n"
        f"## Config\n\n{_table(flatten_params(config))}\n"
    )
    artifact_id = create_markdown_artifact(key=key, markdown=markdown, description=title)
    return str(artifact_id)
