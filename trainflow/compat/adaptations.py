"""The record of what a rank adapted to run where it was launched (`cpu_fallback`), and the
error for a framework that set itself up for fewer processes than the launch has."""

import contextlib
import json
import os
from pathlib import Path

from trainflow.errors import SingleProcessFrameworkError

ADAPTATIONS_DIR = "adaptations"


class Record:
    """This rank's adaptations, written to `adaptations/rank_N.json` in its run folder as they
    are made; rank 0 also prints each one."""

    def __init__(self) -> None:
        self.folder: Path | None = None
        self.rank = 0
        self.made: list[str] = []

    def start(self, run_dir: Path, rank: int) -> None:
        self.folder, self.rank, self.made = run_dir / ADAPTATIONS_DIR, rank, []

    def note(self, what: str) -> None:
        """Record one adaptation (once per rank)."""
        if what in self.made:
            return
        self.made.append(what)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"rank_{self.rank}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.made))
            os.replace(tmp, path)
        if self.rank == 0:
            print(f"[trainflow] CPU ranks: {what}", flush=True)


# One rank process, one record: the patches note into it, `cpu_fallback.install` starts it.
record = Record()
note = record.note


def read_adaptations(run_dir: Path) -> list[str]:
    """Every adaptation any rank of the launch in `run_dir` made, in first-seen order."""
    seen: list[str] = []
    folder = run_dir / ADAPTATIONS_DIR
    for path in sorted(folder.glob("rank_*.json")) if folder.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            for what in json.loads(path.read_text()):
                if what not in seen:
                    seen.append(what)
    return seen


def launched_world() -> tuple[int, int]:
    """(ranks in the launch, ranks on this node), from the launch's environment."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
    return size, local


def single_process(framework: str, seen: int, detail: str = "") -> SingleProcessFrameworkError:
    size, _ = launched_world()
    rank = os.environ.get("RANK", "0")
    return SingleProcessFrameworkError(
        f"rank {rank}: {framework} set itself up for {seen} process(es){detail}, but this launch "
        f"has {size} ranks: each rank would train its own copy of the model on all the data. "
        f"Let {framework} take the launched world (do not pin it to one device or process)."
    )
