"""Processes a test started, asserted gone: a zombie waiting for its parent's wait is gone."""

import contextlib
import time

import psutil


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def alive_pids(pids: list[int]) -> list[int]:
    """Those of `pids` that still run."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if alive(psutil.Process(pid)):
                found.append(pid)
    return found


def survivors(procs: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    """The processes still alive after waiting up to `seconds` for them all to exit."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in procs):
            return []
        time.sleep(0.1)
    return [p for p in procs if alive(p)]


def kill_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
