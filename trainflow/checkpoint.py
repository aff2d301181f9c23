"""Checkpoint folders: one per step, complete only once rank 0 has written its marker.

    <root>/step_000100/   the technique's files (DCP shards or DeepSpeed's layout)
                 meta.json   {"step": 100, "technique": "fsdp", "world_size": 2}

The marker is written after every rank has finished saving, so a run killed mid-save never
leaves a folder that `latest_checkpoint` would pick.
"""

import json
from pathlib import Path
from typing import Any

MARKER = "meta.json"


def checkpoint_path(root: str | Path, step: int) -> Path:
    """Folder of the checkpoint taken after `step`."""
    return Path(root) / f"step_{step:06d}"


def mark_complete(path: Path, step: int, **info: Any) -> None:
    """Write the completion marker (call on one rank, after all ranks have saved)."""
    (path / MARKER).write_text(json.dumps({"step": step, **info}))


def read_meta(path: str | Path) -> dict[str, Any]:
    """The marker of a complete checkpoint.

    Raises:
        FileNotFoundError: `path` is not a complete checkpoint.
    """
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER})")
    return json.loads(marker.read_text())


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `root`, if any."""
    done = [p for p in Path(root).glob("step_*") if (p / MARKER).is_file()]
    return max(done, key=lambda p: read_meta(p)["step"], default=None)


def resolve(path: str | Path | None) -> Path | None:
    """Where to resume from: `path` itself if it is a complete checkpoint, else the latest
    complete one under it, else None (nothing to resume: start fresh)."""
    if path is None:
        return None
    if (Path(path) / MARKER).is_file():
        return Path(path)
    return latest_checkpoint(path)
