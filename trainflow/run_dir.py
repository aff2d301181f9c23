"""The directory one launch shares between the caller, the agent and the ranks.

Layout::

    spec.json             launch plan (written by the caller)
    payload.pkl           function and arguments (cloudpickle)
    agent.log             torch elastic agent output
    agent_error.txt       the agent's failure summary, when it failed
    logs/rank_<r>.log     everything rank r printed (stdout and stderr, C level included)
    results/rank_<r>.pkl  rank r's return value
    results/rank_<r>.err  rank r's error record

Only logs and the spec are kept after the launch; payload and results are removed once read.
"""

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_RANK_FILE = re.compile(r"^rank_(\d+)\.(log|pkl|err)$")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def spec(self) -> Path:
        return self.path / "spec.json"

    @property
    def payload(self) -> Path:
        return self.path / "payload.pkl"

    @property
    def agent_log(self) -> Path:
        return self.path / "agent.log"

    @property
    def agent_error(self) -> Path:
        return self.path / "agent_error.txt"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def results(self) -> Path:
        return self.path / "results"

    def create(self, spec: dict[str, Any], payload: bytes) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.results.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.spec, json.dumps(spec, indent=2).encode())
        _atomic_write(self.payload, payload)

    def read_spec(self) -> dict[str, Any]:
        return json.loads(self.spec.read_text())

    def log_path(self, rank: int) -> Path:
        return self.logs / f"rank_{rank}.log"

    def write_result(self, rank: int, data: bytes) -> None:
        _atomic_write(self.results / f"rank_{rank}.pkl", data)

    def write_error(self, rank: int, data: bytes) -> None:
        _atomic_write(self.results / f"rank_{rank}.err", data)

    def clear_error(self, rank: int) -> None:
        (self.results / f"rank_{rank}.err").unlink(missing_ok=True)

    def _ranks(self, folder: Path, suffix: str) -> dict[int, Path]:
        found = {}
        if folder.is_dir():
            for entry in folder.iterdir():
                m = _RANK_FILE.match(entry.name)
                if m and m.group(2) == suffix:
                    found[int(m.group(1))] = entry
        return dict(sorted(found.items()))

    def log_files(self) -> dict[int, Path]:
        return self._ranks(self.logs, "log")

    def result_files(self) -> dict[int, Path]:
        return self._ranks(self.results, "pkl")

    def error_files(self) -> dict[int, Path]:
        return self._ranks(self.results, "err")

    def discard_payloads(self) -> None:
        """Remove pickled inputs and outputs (they can be large); keep spec and logs."""
        self.payload.unlink(missing_ok=True)
        for files in (self.result_files(), self.error_files()):
            for path in files.values():
                path.unlink(missing_ok=True)
