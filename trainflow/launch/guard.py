"""Run a helper command that must never outlive the process that needs it.

    python -m trainflow.launch.guard PARENT_PID -- CMD [ARGS...]

Started in its own session (`start_new_session=True`), the guard leads a process group that
holds the command and anything the command starts. Being in another session keeps a terminal's
Ctrl-C (sent to the whole foreground group) from reaching the helper, so the process that uses
it can still talk to it while it shuts down. The price is that nothing stops the group when
that process dies without cleaning up (SIGKILL, OOM), so the guard watches its parent: when
the parent is gone, or when the guard itself gets SIGTERM, SIGHUP or SIGINT, it stops its whole
group (SIGTERM, then SIGKILL after a grace period).

Linux tells the guard at once that its parent died (`prctl(PR_SET_PDEATHSIG)`); elsewhere, and
as a fallback, the guard polls `os.getppid()`. The death signal follows the parent *thread*
that started the guard, so start it from a thread that lives as long as the helper is needed
(the main thread).

No imports beyond the standard library: the guard starts in a few milliseconds.
"""

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys

POLL_S = 0.2
GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1


class _Stop(Exception):
    """Raised by the signal handlers: stop the group."""


_stopping = False


def _raise_stop(signum: int, frame: object) -> None:
    # Only the first signal interrupts; a second one must not break off the stopping.
    global _stopping
    if not _stopping:
        _stopping = True
        raise _Stop(signum)


def _ask_for_death_signal() -> None:
    """Have Linux send SIGTERM when the parent dies (a no-op where prctl is missing)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def stop_group(child: subprocess.Popen | None, grace_s: float = GRACE_S) -> None:
    """SIGTERM the guard's group, wait up to `grace_s` for the command, then SIGKILL the group.

    The guard ignores its own SIGTERM while doing this; the final SIGKILL, if needed, takes the
    guard down with the rest. Without a `child` (a signal arrived while it was being started,
    so its pid may be unknown) the group is killed at once.
    """
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    group = os.getpgrp()
    if child is None:
        os.killpg(group, signal.SIGKILL)
        return
    os.killpg(group, signal.SIGTERM)
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(group, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(
            "usage: python -m trainflow.launch.guard PARENT_PID -- CMD [ARGS...]", file=sys.stderr
        )
        return 2
    parent_pid, command = int(argv[0]), argv[2:]
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _raise_stop)
    _ask_for_death_signal()
    child: subprocess.Popen | None = None
    try:
        if os.getppid() != parent_pid:  # the parent died before the death signal was armed
            return 1
        child = subprocess.Popen(command)
        while True:
            try:
                code = child.wait(timeout=POLL_S)
                return code if code >= 0 else 128 - code  # killed by a signal: 128 + signal
            except subprocess.TimeoutExpired:
                pass
            if os.getppid() != parent_pid:
                _raise_stop(0, None)
    except _Stop:
        stop_group(child)
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
