"""What went wrong on the ranks, in words: tracebacks with the caller's source, stack dumps of
stuck ranks, the hang watchdog and the ranks' error records."""

import contextlib
import linecache
import os
import pickle
import re
import signal
import time
from collections.abc import Sequence
from typing import Any

import cloudpickle

from trainflow.errors import Preempted
from trainflow.launch.run_dir import RunDir
from trainflow.launch.ship import DYNAMIC_CODE, CodeSpan

# The type name a rank's error record gives a stop on request.
PREEMPTED_TYPE = f"{Preempted.__module__}.{Preempted.__qualname__}"
# How long to wait for a rank's stack dump; faulthandler writes it within milliseconds.
STACK_DUMP_WAIT_S = 3.0
# Frames shown per thread of a stuck rank's stack.
STACK_FRAMES = 20


def ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


_THREAD_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+.*:$")
_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
# What NCCL's watchdog prints before it aborts a rank whose collective timed out.
COLLECTIVE_ABORT = re.compile(
    r"Watchdog caught collective operation timeout|ProcessGroupNCCL.*(timed out|timeout)"
)
# Frames from here down in a rank's stack are the launcher's own.
_WORKER_FILE = os.path.join("trainflow", "launch", "worker.py")


# A frame of torch.distributed's collectives: a traceback's (`line 12, in all_reduce`) or a
# stack dump's (`line 12 in all_reduce`).
_COLLECTIVE_FRAME = re.compile(
    r'File "[^"]*distributed_c10d\.py", line \d+,? in (?P<func>[A-Za-z]\w*)'
)
# Functions of that file that are plumbing, not a collective a rank calls.
_NOT_COLLECTIVES = {"wrapper", "wait"}
# NCCL's watchdog names the collective it timed out (`OpType=ALLREDUCE`).
_NCCL_OP = re.compile(r"OpType=(\w+)")


def collective_in(text: str, newest_first: bool = False) -> str | None:
    """The torch.distributed collective a traceback or stack shows a rank waiting in
    (`all_reduce`, `barrier`), the one the rank's own code called; None when it shows none.

    Args:
        text: A traceback (oldest call first) or a faulthandler stack (`newest_first`).
    """
    names = [
        m["func"]
        for m in _COLLECTIVE_FRAME.finditer(text)
        if m["func"] not in _NOT_COLLECTIVES and not m["func"].startswith("_")
    ]
    if names:
        return names[-1] if newest_first else names[0]
    op = _NCCL_OP.search(text)
    return op[1].lower() if op else None


def shipped_file(shipped: Sequence[CodeSpan], func: str, lineno: int) -> str | None:
    return next((f for name, a, b, f in shipped if name == func and a <= lineno <= b), None)


_TRACEBACK_DYNAMIC_FRAME = re.compile(
    rf'^(?P<indent> *)File "{DYNAMIC_CODE}", line (?P<line>\d+), in (?P<func>.+)$', re.MULTILINE
)


def resolve_traceback(text: str, shipped: Sequence[CodeSpan]) -> str:
    """A rank's traceback with the caller's file and source line for code shipped by value."""

    def resolve(m: re.Match) -> str:
        lineno, func, indent = int(m["line"]), m["func"], m["indent"]
        path = shipped_file(shipped, func, lineno)
        if path is None:
            return m[0]
        source = linecache.getline(path, lineno).strip()
        return f'{indent}File "{path}", line {lineno}, in {func}' + (
            f"\n{indent}  {source}" if source else ""
        )

    return _TRACEBACK_DYNAMIC_FRAME.sub(resolve, text)


def format_stack_dump(text: str, shipped: Sequence[CodeSpan] = ()) -> str | None:
    """The faulthandler dump in `text` (rank output after SIGUSR1), with each frame's source.

    faulthandler lists the most recent call first and names only file, line and function;
    the source line under each frame is what shows where the rank waits (`time.sleep(600)`,
    `dist.all_reduce(t)`). Frames from the worker down (torch elastic, multiprocessing) are
    left out, and at most `STACK_FRAMES` frames are shown per thread.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _THREAD_HEADER.match(line)), None)
    if start is None:
        return None
    out: list[str] = []
    frames = 0
    for line in lines[start:]:
        if _THREAD_HEADER.match(line):
            out.append(line)
            frames = 0
            continue
        if not line:
            continue
        if not line.startswith("  "):
            break  # the rank printed something else after its dump
        m = _FRAME.match(line)
        if m and m["file"].endswith(_WORKER_FILE):
            frames = STACK_FRAMES  # the launcher's own frames from here down
        frames += 1
        if frames > STACK_FRAMES:
            continue
        if not m:
            out.append(line)
            continue
        path, lineno, func = m["file"], int(m["line"]), m["func"]
        if path == DYNAMIC_CODE:
            path = shipped_file(shipped, func, lineno) or path
        out.append(f'  File "{path}", line {lineno} in {func}')
        source = linecache.getline(path, lineno).strip()
        if source:
            out.append(f"    {source}")
    return "\n".join(out)


def dump_stacks(
    rd: RunDir, pids: dict[int, int], shipped: Sequence[CodeSpan] = ()
) -> dict[int, str]:
    """Ask each rank for its Python stacks; return them, formatted, by rank.

    SIGUSR1 makes faulthandler write every thread's stack to the rank's log from the signal
    handler itself, so a rank stuck in C code (a collective, a sleep) answers too. A rank that
    does not answer within `STACK_DUMP_WAIT_S` gets a note instead.
    """
    offsets: dict[int, int] = {}
    for rank, pid in pids.items():
        try:
            offsets[rank] = rd.log_path(rank).stat().st_size
        except FileNotFoundError:
            offsets[rank] = 0
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    dumps: dict[int, str] = {}
    seen: dict[int, bytes] = {}
    deadline = time.monotonic() + STACK_DUMP_WAIT_S
    while len(dumps) < len(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
        for rank in pids:
            if rank in dumps:
                continue
            try:
                with open(rd.log_path(rank), "rb") as f:
                    f.seek(offsets[rank])
                    data = f.read()
            except FileNotFoundError:
                continue
            # Written at once by the handler: complete once it stops growing.
            if data == seen.get(rank):
                formatted = format_stack_dump(data.decode("utf-8", errors="replace"), shipped)
                if formatted:
                    dumps[rank] = formatted
            seen[rank] = data
    for rank in pids:
        if rank not in dumps:
            text = seen.get(rank, b"").decode("utf-8", errors="replace")
            partial = format_stack_dump(text, shipped)
            dumps[rank] = partial or "(no stack: the rank did not answer SIGUSR1)"
    return dumps


def stacks_text(dumps: dict[int, str], steps: dict[int, int | None]) -> str:
    parts = []
    for rank, dump in sorted(dumps.items()):
        step = steps.get(rank)
        at = f" (last step {step})" if step is not None else ""
        parts.append(f"\n\nStack of rank {rank}{at} when it was stopped:\n{dump}")
    return "".join(parts)


class Watchdog:
    """Says when no rank's heartbeat advanced for `timeout` seconds.

    Progress is a change of a rank's heartbeat record, timed on this process's clock, so the
    ranks need no clock in common with the caller. It arms only once every rank of the
    latest attempt has beaten: start-up (imports, data loading, a first compiled step) never
    counts, and a restarted attempt starts over.
    """

    def __init__(self, rd: RunDir, timeout: float, nproc: int):
        self.rd = rd
        self.timeout = timeout
        self.nproc = nproc
        self.attempt = -1
        self.beats: dict[int, dict[str, Any]] = {}
        self.changed_at = 0.0

    def stalled(self, now: float) -> bool:
        beats = self.rd.heartbeats()
        attempt = max((b["attempt"] for b in beats.values()), default=0)
        current = {r: b for r, b in beats.items() if b["attempt"] == attempt}
        if attempt != self.attempt or current != self.beats:
            self.attempt, self.beats, self.changed_at = attempt, current, now
        return len(current) >= self.nproc and now - self.changed_at > self.timeout


def read_errors(rd: RunDir) -> dict[int, dict[str, Any]]:
    return {r: pickle.loads(p.read_bytes()) for r, p in rd.error_files().items()}


def first_failure(errors: dict[int, dict[str, Any]]) -> int:
    return min(errors, key=lambda r: (errors[r]["time"], r))


def shipped_cause(rec: dict[str, Any]) -> BaseException | None:
    if rec["exception"] is None:
        return None
    # The exception class may not import in the caller; the message still names it.
    try:
        return cloudpickle.loads(rec["exception"])
    except Exception:
        return None
