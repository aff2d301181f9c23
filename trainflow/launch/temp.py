"""What a launch keeps in the system's temp folder, and clearing what a dead process left there.

Two kinds of entries go there, each named after the process that removes it, so that a later
launch on the machine can tell what nobody will remove any more (its owner was SIGKILLed, or
the machine lost power):

- `trainflow-standby-<caller pid>-*.log`: a standby agent's output until a launch claims it
  (`trainflow.launch.standby`); the caller removes it.
- `trainflow-ranks-<agent pid>-*/`: the ranks' temp folder for one launch (their TMPDIR), which
  their agent removes once they have ended. Whatever the ranks or the libraries they import put
  in the temp folder and leave (a `TemporaryDirectory` of a process that ends with `os._exit`,
  a checkpoint uploader's scratch folder) goes with it.

Both are in the system's temp folder, not in the launch folder: short paths, as a Unix socket
made there (a multiprocessing listener) allows 107 bytes.
"""

import getpass
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

STANDBY_PREFIX = "trainflow-standby-"
RANKS_PREFIX = "trainflow-ranks-"


def own_prefix(kind: str) -> str:
    """The name prefix of an entry of `kind` (a `*_PREFIX`) that this process owns."""
    return f"{kind}{os.getpid()}-"


def remove_left_by_dead(kind: str, folder: str | Path | None = None) -> list[Path]:
    """Remove this user's entries of `kind` in `folder` (the temp folder) whose owner has died.

    An owner whose process id is in use again keeps its entries until a later call; what
    another user left is theirs. Returns what was removed.
    """
    folder = Path(folder if folder is not None else tempfile.gettempdir())
    removed = []
    for path in folder.glob(kind + "*"):
        pid = path.name[len(kind) :].split("-", 1)[0]
        if not pid.isdigit() or psutil.pid_exists(int(pid)):
            continue
        try:
            if path.lstat().st_uid != os.getuid():
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            continue
        removed.append(path)
    if removed:
        logger.info("removed %d temp entries left by ended launches: %s", len(removed), removed)
    return removed


def inductor_cache_default(system_temp: str) -> str:
    """Where torch's compiler keeps its cache when TORCHINDUCTOR_CACHE_DIR is unset: in the
    system's temp folder, named after the user (torch 2.14's `default_cache_dir`). The ranks
    keep using it when their own TMPDIR is a launch's folder, so compiled kernels outlive a
    launch as they would without one."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's arbitrary user)
        user = str(os.getuid())
    return os.path.join(system_temp, "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def make_ranks_temp(system_temp: str, record: Path) -> Path:
    """A fresh temp folder for one launch's ranks on this node, its path written to `record`
    (in the launch folder), after clearing those of agents that died without removing theirs."""
    remove_left_by_dead(RANKS_PREFIX, system_temp)
    folder = Path(tempfile.mkdtemp(prefix=own_prefix(RANKS_PREFIX), dir=system_temp))
    record.write_text(str(folder))
    return folder


def remove_ranks_temp(folder: Path | None) -> None:
    """Remove a launch's rank temp folder (once its ranks, and what they started, have ended)."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def remove_recorded_ranks_temp(record: Path) -> None:
    """The caller's share, once the agent has ended: remove the ranks' temp folder `record`
    names, if the agent was killed before it could (a follower node whose leader is gone)."""
    try:
        folder = Path(record.read_text())
    except OSError:  # the agent made none (it failed first), or the launch folder is gone
        return
    if folder.name.startswith(RANKS_PREFIX):
        remove_ranks_temp(folder)
