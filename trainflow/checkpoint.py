"""Checkpoint folders: written aside, published whole by one rename, the last K kept.

    <root>/.step_000100.partial/   being written: never read, removed when found stale
    <root>/step_000100/            complete: the technique's files (DCP shards or DeepSpeed's
                                   layout), one `rank_<r>.state.pt` per rank (RNG streams and
                                   data position) and `meta.json` {"step": 100, ...}
    <root>/checkpoint-100/         the Hugging Face Trainer's own layout, complete once our
                                   `meta.json` is in it (written after every rank has saved)

Every rank saves into the partial folder; after a barrier rank 0 writes the marker and renames
the folder, so a run killed mid-save leaves nothing `latest_checkpoint` would pick, and the
checkpoint a resume reads is always whole. A run kept in object storage has each complete
checkpoint uploaded by rank 0, its marker last (`trainflow.storage`).
"""

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

from trainflow.compat.safe_load import check_checkpoint, torch_load

MARKER = "meta.json"
_STEP_DIR = re.compile(r"^(?:step_(\d+)|checkpoint-(\d+))$")
_PARTIAL_DIR = re.compile(r"^\.(?:step_\d+|checkpoint-\d+)\.partial$")


def step_of(name: str) -> int | None:
    """The step a checkpoint folder's name says (`step_000100`, `checkpoint-100`), else None."""
    found = _STEP_DIR.match(name)
    return int(found.group(1) or found.group(2)) if found else None


def checkpoint_path(root: str | Path, step: int) -> Path:
    """Folder of the checkpoint taken after `step`."""
    return Path(root) / f"step_{step:06d}"


def partial_path(path: str | Path) -> Path:
    """Where the checkpoint that will be published at `path` is written first."""
    path = Path(path)
    return path.parent / f".{path.name}.partial"


def mark_complete(path: Path, step: int, **info: Any) -> None:
    """Write the completion marker (call on one rank, after all ranks have saved)."""
    tmp = path / f".{MARKER}.tmp"
    tmp.write_text(json.dumps({"step": step, **info}))
    os.replace(tmp, path / MARKER)


def publish(partial: Path, path: Path, step: int, keep: int | None = None, **info: Any) -> None:
    """Mark the fully written `partial` folder complete and make it visible as `path`.

    Call on one rank, after every rank has saved. With `keep`, older complete checkpoints
    beyond the newest `keep` are deleted.
    """
    mark_complete(partial, step, **info)
    if path.exists():  # the same step saved again (a resumed run re-reaching it)
        shutil.rmtree(path)
    os.replace(partial, path)
    if keep is not None:
        prune(path.parent, keep)


def read_meta(path: str | Path) -> dict[str, Any]:
    """The marker of a complete checkpoint.

    Raises:
        FileNotFoundError: `path` is not a complete checkpoint.
    """
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER})")
    return json.loads(marker.read_text())


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return sorted(done, key=lambda p: read_meta(p)["step"])


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `root`, if any."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep`; return what was deleted."""
    old = complete_checkpoints(root)[:-keep] if keep > 0 else []
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def remove_partial(root: str | Path) -> list[Path]:
    """Delete checkpoint folders a stopped save left incomplete; return what was deleted.

    Call when no rank is saving (before a launch, or after one ended).
    """
    root = Path(root)
    if not root.is_dir():
        return []
    stale = [
        p
        for p in root.iterdir()
        if p.is_dir()
        and (_PARTIAL_DIR.match(p.name) or (_STEP_DIR.match(p.name) and not (p / MARKER).exists()))
    ]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def resolve(path: str | Path | None) -> Path | None:
    """Where to resume from: `path` itself if it is a complete checkpoint, else the latest
    complete one under it, else None (nothing to resume: start fresh).

    Every file of the checkpoint found is checked first: none may hold pickled code
    (`safe_load.check_checkpoint`), whichever framework will load it.

    Raises:
        UnsafeCheckpointError: a file of the checkpoint holds more than data; it names the file.
    """
    if path is None:
        return None
    found = Path(path) if (Path(path) / MARKER).is_file() else latest_checkpoint(path)
    if found is not None:
        check_checkpoint(found)
    return found


def uri(path: Path | None) -> str | None:
    """A checkpoint folder as a `file://` URI (None stays None)."""
    return path.resolve().as_uri() if path is not None else None


def _rank_state_file(folder: Path, rank: int) -> Path:
    return folder / f"rank_{rank}.state.pt"


def save_rank_state(folder: Path, rank: int, extra: dict[str, Any] | None = None) -> None:
    """Save this rank's RNG streams (torch, CUDA, Python, NumPy) and `extra` into `folder`.

    `extra` holds small values the technique's checkpoint does not: the data position, for one.
    """
    import numpy as np
    import torch

    np_state: Any = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "extra": extra or {},
    }
    torch.save(state, _rank_state_file(folder, rank))


def load_rank_state(folder: Path, rank: int) -> dict[str, Any] | None:
    """Restore this rank's RNG streams from `folder`; return its `extra` (None: no state saved
    for this rank, as when resuming on more ranks than saved the checkpoint).

    Raises:
        UnsafeCheckpointError: the file holds more than tensors and plain values.
    """
    import numpy as np
    import torch

    path = _rank_state_file(folder, rank)
    if not path.is_file():
        return None
    state = torch_load(path)
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    return dict(state["extra"])
