"""Remove `streaming` shared memory and lock files left behind by runs that are gone.

`streaming` keeps each dataset's coordination state in `/dev/shm/<prefix>_<name>` and lock files
`<tmp>/<prefix>_*_filelock`, where the prefix is the first number whose lock files do not exist.
A run killed with its process group (an OOM kill, a launcher stopping a job) leaves its shared
memory behind, and lock files are left even by clean exits. `streaming`'s own
`clean_stale_shared_memory()` stops at the first unused prefix, so it misses most leftovers, and
it unlinks memory that live jobs still use. Here a prefix counts as stale only when no process
maps any of its shared memory, so cleaning is safe while other jobs read on the machine.
"""

import contextlib
import fcntl
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# `streaming.base.constant.SHM_TO_CLEAN`, named here so that a pipeline's process can clean up
# after its ranks without importing `streaming` (and torch); a test keeps the two equal.
SHM_NAMES = (
    "locals",
    "barrier",
    "next_epoch",
    "cache_usage",
    "shard_states",
    "shard_access_times",
    "resume",
    "epoch_shape",
    "epoch_data",
)
_SHM_NAME = re.compile(r"^(\d{6})_(" + "|".join(SHM_NAMES) + r")$")
_LOCK_NAME = re.compile(r"^(\d{6})_(barrier|cache)_filelock$")
_MAPPED = re.compile(r"/dev/shm/(\d{6})_")
# A file this young may belong to a run between creating and mapping it.
GRACE_S = 2.0


@contextlib.contextmanager
def registering(leader: bool) -> Iterator[None]:
    """Hold, in a launch's rank 0, the machine's lock on registering `streaming` datasets.

    `streaming` picks a dataset's prefix as the first unused number, then creates its shared
    memory under it: two launches picking at once on one machine both take the same number, and
    the second one's rank fails with `FileExistsError: '/000055_locals'`. Every rank of a launch
    does its own pick, so the lock must cover the whole launch's registration: its rank 0
    (`leader`) takes it and the launch's other ranks pick between barriers inside its hold (the
    caller's). On a launch's other machines, ranks pick unguarded, as without the lock. The
    lock is `flock` on the folder the shared memory lives in (`/dev/shm`, else the temp folder):
    machine-wide, nothing to create or leave behind, released if the process dies.
    """
    if not leader:
        yield
        return
    folder = SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())
    fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _candidates() -> list[tuple[Path, re.Pattern[str]]]:
    """Every entry of `/dev/shm` (where there is one) and of the temp folder, each with the
    pattern a `streaming` file there would match."""
    found = [(p, _SHM_NAME) for p in SHM_DIR.iterdir()] if SHM_DIR.is_dir() else []
    found += [(p, _LOCK_NAME) for p in Path(tempfile.gettempdir()).iterdir()]
    return found


def _prefixes(candidates: list[tuple[Path, re.Pattern[str]]]) -> set[str]:
    return {m.group(1) for p, pattern in candidates if (m := pattern.match(p.name))}


def _prefixes_in_use() -> set[str]:
    live: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            live.update(_MAPPED.findall(maps.read_text()))
        except OSError:  # the process exited, or is not ours to read
            continue
    return live


def _unused_age(path: Path, pattern: re.Pattern[str], live: set[str], now: float) -> float | None:
    """How old `path` is, if it is a `streaming` file of ours whose prefix no process maps."""
    match = pattern.match(path.name)
    if not match or match.group(1) in live:
        return None
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return now - stat.st_mtime if stat.st_uid == os.getuid() else None


def _stale(path: Path, pattern: re.Pattern[str], live: set[str], now: float) -> bool:
    age = _unused_age(path, pattern, live, now)
    return age is not None and age > GRACE_S


def too_young_to_judge() -> list[str]:
    """Our shared memory that no process maps but is younger than `GRACE_S`: a run may be
    about to map it, or ranks stopped just now left it. Look again once it is older. (Lock
    files take no memory: a later clean-up removes them.)"""
    if not SHM_DIR.is_dir():
        return []
    listed = list(SHM_DIR.iterdir())
    live = _prefixes_in_use()
    now = time.time()
    young = []
    for path in listed:
        age = _unused_age(path, _SHM_NAME, live, now)
        if age is not None and age <= GRACE_S:
            young.append(str(path))
    return young


def clean_stale_streaming_state() -> list[str]:
    """Delete shared memory and lock files of `streaming` runs that no process uses.

    Falls back to `streaming`'s own cleanup where `/dev/shm` and `/proc` do not exist.

    Returns:
        Paths removed.
    """
    if not (SHM_DIR.is_dir() and Path("/proc/self/maps").is_file()):
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        return []
    candidates = _candidates()
    # List first, then read the maps: anything listed and live is mapped by then.
    live = _prefixes_in_use()
    now = time.time()
    removed = []
    for path, pattern in candidates:
        if _stale(path, pattern, live, now):
            try:
                path.unlink()
            except OSError:
                continue
            removed.append(str(path))
    if removed:
        logger.info("removed %d stale streaming files: %s", len(removed), removed)
    return removed


def streaming_prefixes() -> set[str]:
    """The prefixes of `streaming` shared memory in `/dev/shm` and of its lock files in the temp
    folder now."""
    return _prefixes(_candidates())


def release_streaming_state_since(before: set[str]) -> list[str]:
    """Remove the `streaming` shared memory and lock files of prefixes that appeared since
    `before` (taken with `streaming_prefixes` when a launch or a read started) and that no
    process maps any more: what the launch's ranks left when they were stopped (a hang, a
    failure, a kill), or the lock files a finished read leaves, without the `GRACE_S` wait,
    which is for memory that may not be mapped yet. Memory that other runs map is kept.

    Returns:
        Paths removed.
    """
    candidates = _candidates()
    new = _prefixes(candidates) - before
    if not new:
        return []
    live = _prefixes_in_use()  # after the listing: anything listed and live is mapped by then
    removed = []
    for path, pattern in candidates:
        match = pattern.match(path.name)
        if not match or match.group(1) not in new or match.group(1) in live:
            continue
        try:
            if path.stat().st_uid != os.getuid():
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(str(path))
    if removed:
        logger.info("removed %d streaming files the launch's ranks left: %s", len(removed), removed)
    return removed
