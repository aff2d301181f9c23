"""Process groups of a launch: find, stop and kill them, and the ranks in them.

A launch's agent leads its own process group (it starts in a session of its own); its ranks
and whatever they start are in that group, or, if they left it, the agent's descendants (the
agent is their subreaper).
"""

import contextlib
import os
import signal
import time

import psutil

from trainflow.launch.run_dir import RunDir
from trainflow.launch.spec import SHUTDOWN_GRACE_S


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def _wait_group_gone(pgid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _kill_adopted(leader_pid: int, rounds: int = 5) -> None:
    """SIGKILL the leader's descendants that left its process group, while it still lives.

    The agent (the group's leader) is the subreaper of the launch: a process a rank started in
    a session of its own is its descendant but no member of the group, so a group kill misses
    it, and once the agent is gone it would be re-parented to init. Killed here first; a few
    rounds catch what a dying rank started meanwhile.
    """
    for _ in range(rounds):
        try:
            descendants = psutil.Process(leader_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        outside = []
        for proc in descendants:
            with contextlib.suppress(ProcessLookupError, psutil.Error):
                if os.getpgid(proc.pid) != leader_pid:
                    proc.kill()
                    outside.append(proc)
        if not outside:
            return
        psutil.wait_procs(outside, timeout=1)


def kill_process_group(pgid: int) -> None:
    """SIGKILL every process of the group, and what its leader adopted; wait (bounded)."""
    _kill_adopted(pgid)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    _wait_group_gone(pgid, SHUTDOWN_GRACE_S)


def stop_process_group(pgid: int, grace_s: float = SHUTDOWN_GRACE_S) -> bool:
    """SIGTERM every live process of the group, then SIGKILL what is left after `grace_s`.

    Returns whether the group was gone within `grace_s` (False: it had to be killed)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    if _wait_group_gone(pgid, grace_s):
        return True
    kill_process_group(pgid)
    return False


def live_ranks(rd: RunDir, pgid: int, attempt: int | None = None) -> dict[int, int]:
    """`{rank: pid}` of this node's ranks of `attempt` (default: the latest) still running."""
    procs = rd.rank_processes()
    if attempt is None:
        attempt = max((p["attempt"] for p in procs.values()), default=0)
    live = {}
    for rank, rec in procs.items():
        if rec["attempt"] != attempt:
            continue
        try:
            proc = psutil.Process(rec["pid"])
            # The group check guards against a pid reused by an unrelated process.
            if proc.status() != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                live[rank] = proc.pid
        except (ProcessLookupError, psutil.Error):
            continue
    return live


def dead_ranks(rd: RunDir, pgid: int) -> list[int]:
    """Ranks of the latest attempt whose process is gone without a result or an error."""
    procs = rd.rank_processes()
    attempt = max((p["attempt"] for p in procs.values()), default=0)
    live = live_ranks(rd, pgid, attempt)
    done = {*rd.result_files(), *rd.error_files()}
    return sorted(
        r for r, p in procs.items() if p["attempt"] == attempt and r not in live and r not in done
    )


def kill_ranks(rd: RunDir, pgid: int, attempt: int | None = None) -> None:
    """SIGKILL this node's live ranks of `attempt` (default: the latest).

    Naming the attempt matters with restarts: the elastic agent may start the next attempt
    between the moment a failure is seen and the kill, and those new ranks must live.
    """
    for pid in live_ranks(rd, pgid, attempt).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
