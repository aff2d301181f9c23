"""Read prefect.yaml's deployments and load their flows: one source of truth for serve and tests."""

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_YAML = REPO_ROOT / "prefect.yaml"


@dataclass(frozen=True)
class DeploymentEntry:
    """One deployment of prefect.yaml, as `flow_name/name` once its flow is loaded."""

    name: str
    entrypoint: str
    parameters: dict[str, Any]
    description: str
    work_pool: str | None
    job_variables: dict[str, Any]
    schedules: list[dict[str, Any]] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)

    def load_flow(self) -> Any:
        """Import the flow object named by the entrypoint (`path/to/file.py:flow_name`)."""
        path, _, attr = self.entrypoint.partition(":")
        if not (REPO_ROOT / path).is_file():
            raise FileNotFoundError(f"deployment {self.name!r}: entrypoint {path} not found")
        module_name = path.removesuffix(".py").replace("/", ".")
        if str(REPO_ROOT) not in sys.path:
            sys.path.insert(0, str(REPO_ROOT))
        return getattr(importlib.import_module(module_name), attr)

    @property
    def full_name(self) -> str:
        return f"{self.load_flow().name}/{self.name}"


def deployments(path: Path = PREFECT_YAML) -> list[DeploymentEntry]:
    """Every deployment declared in `path`."""
    spec = yaml.safe_load(path.read_text())
    entries = []
    for item in spec.get("deployments", []):
        pool = item.get("work_pool") or {}
        entries.append(
            DeploymentEntry(
                name=item["name"],
                entrypoint=item["entrypoint"],
                parameters=item.get("parameters") or {},
                description=item.get("description", ""),
                work_pool=pool.get("name"),
                job_variables=pool.get("job_variables") or {},
                schedules=item.get("schedules") or [],
                tags=item.get("tags") or [],
            )
        )
    return entries
