"""The directory one launch shares between the caller, the agent and the ranks.

Layout::

    spec.json             launch plan (written by the caller)
    payload.pkl           function and arguments (cloudpickle)
    agent.log             torch elastic agent output
    agent_error.txt       the agent's failure summary, when it failed
    logs/rank_<r>.log     everything rank r printed (stdout and stderr, C level included)
    results/rank_<r>.pkl  rank r's return value
    results/rank_<r>.err  rank r's error record
    ranks/rank_<r>.pid    rank r's process id and restart attempt (written when it starts)
    ranks/rank_<r>.beat   rank r's last heartbeat: step, wall time, attempt
    ranks/rank_<r>.stops  rank r checks for stop requests (`runtime.should_stop`): attempt

Logs, the spec and the rank records are kept after the launch (the last heartbeats say where
each rank got to); payload and results are removed once read.
"""

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from trainflow.errors import LaunchConfigError
from trainflow.launch.spec import LaunchSpec
from trainflow.paths import trainflow_home

KEEP_RUNS_ENV = "TRAINFLOW_KEEP_RUNS"
DEFAULT_KEEP_RUNS = 50

_RANK_FILE = re.compile(r"^rank_(\d+)\.(log|pkl|err|pid|beat|stops)$")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class Heartbeat:
    """One rank's heartbeat file, kept open: a beat is one fixed-size write in place.

    A few microseconds, where writing a new file and renaming it over the old one costs a
    few hundred (ext4), so a rank can beat every step. A reader may catch a write half done:
    the step is written at both ends of the record, and a record whose ends disagree or
    that does not parse is skipped.
    """

    _FORMAT = b"%20d %20.6f %8d %20d\n"

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def beat(self, step: int, attempt: int) -> None:
        os.pwrite(self.fd, self._FORMAT % (step, time.time(), attempt, step), 0)

    @staticmethod
    def parse(data: bytes) -> dict[str, Any] | None:
        fields = data.split()
        if len(fields) != 4 or not data.endswith(b"\n") or fields[0] != fields[3]:
            return None
        try:
            return {"step": int(fields[0]), "time": float(fields[1]), "attempt": int(fields[2])}
        except ValueError:
            return None


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
    def sources(self) -> Path:
        """The caller's source of the code it shipped by value (`{file: lines}`, JSON)."""
        return self.path / "sources.json"

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
    def elastic(self) -> Path:
        """torch elastic's own per-attempt logs."""
        return self.path / "elastic"

    @property
    def elastic_tmp(self) -> Path:
        """The agent's temp folder: torch's per-rank error files, which it leaves behind."""
        return self.path / "elastic" / "tmp"

    @property
    def ranks_temp(self) -> Path:
        """Holds the path of the ranks' temp folder on this node (`trainflow.launch.temp`), for
        the caller to remove if the agent could not (it was killed)."""
        return self.path / "ranks_temp"

    @property
    def results(self) -> Path:
        return self.path / "results"

    @property
    def ranks(self) -> Path:
        return self.path / "ranks"

    def create(
        self, spec: LaunchSpec, payload: bytes, sources: dict[str, list[str]] | None = None
    ) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.results.mkdir(parents=True, exist_ok=True)
        self.ranks.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.spec, spec.to_json().encode())
        _atomic_write(self.sources, json.dumps(sources or {}).encode())
        _atomic_write(self.payload, payload)

    def read_spec(self) -> LaunchSpec:
        """The launch's spec, checked (`LaunchSpecError` names what this release cannot read)."""
        return LaunchSpec.from_json(self.spec.read_text())

    def log_path(self, rank: int) -> Path:
        return self.logs / f"rank_{rank}.log"

    def write_result(self, rank: int, data: bytes) -> None:
        _atomic_write(self.results / f"rank_{rank}.pkl", data)

    def write_error(self, rank: int, data: bytes) -> None:
        _atomic_write(self.results / f"rank_{rank}.err", data)

    def clear_error(self, rank: int) -> None:
        (self.results / f"rank_{rank}.err").unlink(missing_ok=True)

    def write_rank_process(self, rank: int, pid: int, attempt: int) -> None:
        _atomic_write(
            self.ranks / f"rank_{rank}.pid",
            json.dumps({"pid": pid, "attempt": attempt}).encode(),
        )

    def heartbeat(self, rank: int) -> "Heartbeat":
        return Heartbeat(self.ranks / f"rank_{rank}.beat")

    def write_stop_check(self, rank: int, attempt: int) -> None:
        _atomic_write(self.ranks / f"rank_{rank}.stops", json.dumps({"attempt": attempt}).encode())

    def rank_processes(self) -> dict[int, dict[str, int]]:
        """`{rank: {"pid", "attempt"}}` of every rank that started (latest attempt of each)."""
        return self._records(self.ranks, "pid")

    def heartbeats(self) -> dict[int, dict[str, Any]]:
        """`{rank: {"step", "time", "attempt"}}` of every rank that called `runtime.heartbeat`.

        A record caught half-written is left out; the next read has it.
        """
        beats = {}
        for rank, path in self._ranks(self.ranks, "beat").items():
            with contextlib.suppress(FileNotFoundError):
                beat = Heartbeat.parse(path.read_bytes())
                if beat is not None:
                    beats[rank] = beat
        return beats

    def stop_checks(self) -> dict[int, dict[str, int]]:
        """`{rank: {"attempt"}}` of every rank that asked `runtime.should_stop()`."""
        return self._records(self.ranks, "stops")

    def _records(self, folder: Path, suffix: str) -> dict[int, dict[str, Any]]:
        records = {}
        for rank, path in self._ranks(folder, suffix).items():
            # Written by atomic rename, so a record is whole or absent; a rank may replace it
            # between listing and reading.
            with contextlib.suppress(FileNotFoundError, ValueError):
                records[rank] = json.loads(path.read_bytes())
        return records

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


def keep_run_dirs() -> int:
    """How many launch folders `prune_run_dirs` keeps (TRAINFLOW_KEEP_RUNS, default 50)."""
    value = os.environ.get(KEEP_RUNS_ENV, "")
    if not value:
        return DEFAULT_KEEP_RUNS
    if not value.isdigit() or int(value) < 1:
        raise LaunchConfigError(f"{KEEP_RUNS_ENV}={value!r}: give a whole number of at least 1")
    return int(value)


def prune_run_dirs(root: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` launch folders in `root`; never one still in use.

    A folder is in use while the process that launched it lives. Returns what was removed.
    """
    if not root.is_dir():
        return []
    folders = sorted(
        (d for d in root.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime, reverse=True
    )
    removed = []
    for folder in folders[keep:]:
        with contextlib.suppress(OSError, ValueError, KeyError):
            caller = json.loads((folder / "spec.json").read_text())["caller_pid"]
            if psutil.pid_exists(caller):
                continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def stop_path(kind: str) -> Path:
    """A fresh path for the stop file a backend gives a node's launch (a Ray node, a launch
    board's leader or follower): under `$TRAINFLOW_HOME/stops`, never the temp folder, and
    nothing is created until a stop is asked for (`request_stop`). Whoever made it removes it
    when the launch ends."""
    return trainflow_home() / "stops" / f"{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def request_stop(path: Path) -> None:
    """Create the stop file at `path` (see `stop_path`), and its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
