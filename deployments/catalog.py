"""Read prefect.yaml's deployments and load their flows: one source of truth for serve and tests."""

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_YAML = REPO_ROOT / "prefect.yaml"


@dataclass(frozen=True)
class DeploymentEntry:
    name: str
    entrypoint: str
    parameters: dict[str, Any]
    description: str
    cron: str | None

    def load_flow(self) -> Any:
        """Import the flow object named by the entrypoint (`path/to/file.py:flow_name`)."""
        path, _, attr = self.entrypoint.partition(":")
        module_name = path.removesuffix(".py").replace("/", ".")
        if str(REPO_ROOT) not in sys.path:
            sys.path.insert(0, str(REPO_ROOT))
        if importlib.util.find_spec(module_name) is None:
            raise FileNotFoundError(f"deployment {self.name!r}: entrypoint {path} not found")
        module = importlib.import_module(module_name)
        return getattr(module, attr)


def deployments(path: Path = PREFECT_YAML) -> list[DeploymentEntry]:
    spec = yaml.safe_load(path.read_text())
    entries = []
    for item in spec.get("deployments", []):
        schedules = item.get("schedules") or []
        cron = next((s["cron"] for s in schedules if "cron" in s and s.get("active", True)), None)
        entries.append(
            DeploymentEntry(
                name=item["name"],
                entrypoint=item["entrypoint"],
                parameters=item.get("parameters") or {},
                description=item.get("description", ""),
                cron=cron,
            )
        )
    return entries
