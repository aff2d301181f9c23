"""`@distributed`: run a plain Python function on every rank with torch's elastic launcher.

    from trainflow import distributed, runtime

    @distributed(gpus=2, gpu_type="cpu")
    def train(num_epochs: int) -> dict:
        ...
        return {"rank": runtime.get_global_rank()}

    results = train.distributed(num_epochs=3)      # one entry per rank, ordered by rank

The caller writes the function and its arguments (cloudpickle) into a run directory, starts one
helper process (`trainflow._agent`) in its own session that hosts torch's elastic agent, and
supervises it: it streams every rank's output line by line, enforces the timeout, turns the
first failing rank into one clear error, and stops the whole process group at the end, so no
process outlives the call.

Runs that must survive interruptions get three more guards:

- Interrupted (Ctrl-C, a cancel, SIGTERM raised as an exception in the caller), the caller
  sends SIGTERM to every process of the launch. Ranks only note it; at the end of their step
  `runtime.should_stop()` says so on every rank alike, they write a final checkpoint and end.
  After `stop_grace` seconds (or a second Ctrl-C) whatever is left is killed.
- Ranks call `runtime.heartbeat(step)`; with `hang_timeout` set, a launch in which no rank
  advanced for that long is stopped with a `HangError` naming each rank's last step and the
  Python stack where it is stuck (faulthandler dumps it on SIGUSR1).
- A collective waits at most `collective_timeout`. When a rank fails waiting for its peers
  while they are still alive, those peers are the ones that stopped answering: the error
  names them, with their stacks, rather than the rank that noticed.
"""

import contextlib
import functools
import inspect
import json
import linecache
import logging
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Generic, ParamSpec, TypeVar

import cloudpickle
import psutil

from trainflow._adapt import read_adaptations
from trainflow.errors import (
    HangError,
    LaunchConfigError,
    LaunchError,
    LaunchTimeoutError,
    PayloadError,
    Preempted,
    RankError,
    RemoteNotConfiguredError,
    StopRequested,
    first_line,
    is_collective_failure,
)
from trainflow.paths import trainflow_home
from trainflow.resources import LaunchPlan, node_range, ray_cluster_address, resolve_resources
from trainflow.run_dir import RunDir

logger = logging.getLogger(__name__)

_PREEMPTED_TYPE = f"{Preempted.__module__}.{Preempted.__qualname__}"

P = ParamSpec("P")
R = TypeVar("R")

LineSink = Callable[[int, str], None]

RDZV_ENDPOINT_ENV = "TRAINFLOW_RDZV_ENDPOINT"
RUN_ID_ENV = "TRAINFLOW_RUN_ID"
STANDBY_ENV = "TRAINFLOW_STANDBY"
START_METHOD_ENV = "TRAINFLOW_START_METHOD"
KEEP_RUNS_ENV = "TRAINFLOW_KEEP_RUNS"
REMOTE_DEPLOYMENT_ENV = "TRAINFLOW_REMOTE_DEPLOYMENT"
DEFAULT_KEEP_RUNS = 50
# After the first rank fails, torch elastic stops the others; give it this long before we do.
FAILURE_GRACE_S = 5.0
# SIGTERM-to-SIGKILL grace of the final sweep, once the launch is decided.
SHUTDOWN_GRACE_S = 3.0
# A rank died without a Python error: its peers get this long to record how they noticed (a
# collective error) before they are killed.
LOST_RANK_GRACE_S = 1.0
# How often the supervisor reads the ranks' heartbeats (it follows their logs every 0.05 s).
WATCH_EVERY_S = 0.25
# How long to wait for a rank's stack dump; faulthandler writes it within milliseconds.
STACK_DUMP_WAIT_S = 3.0
# Frames shown per thread of a stuck rank's stack.
STACK_FRAMES = 20
# Source shipped with the payload for rank tracebacks, at most (a module, a notebook).
MAX_SHIPPED_SOURCE_BYTES = 2_000_000
# A progress bar redrawn in place is passed on at most this often per rank.
PROGRESS_EVERY_S = 2.0


def _check_seconds(name: str, value: object, zero_ok: bool = False) -> None:
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value >= 0 if zero_ok else value > 0)
    )
    if not ok:
        kind = "a number of seconds >= 0" if zero_ok else "a positive number of seconds"
        raise ValueError(f"{name} must be {kind}, got {value!r}")


def _check_interpreter_path(python: object) -> None:
    if not isinstance(python, str) or not python:
        raise ValueError(f"python must be the path of a Python interpreter, got {python!r}")
    path = Path(python)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ValueError(
            f"python={python!r}: no executable interpreter there (a framework's environment "
            "is made by `bash scripts/setup-framework.sh NAME`)"
        )


@dataclass(frozen=True)
class LaunchOptions:
    """How to launch: the decorator's arguments, validated."""

    gpus: int
    gpu_type: str | None = None
    nnodes: int | str = 1
    timeout: float | None = None
    init_process_group: bool = False
    max_restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    collective_timeout: float = 600.0
    hang_timeout: float | None = None
    stop_grace: float = 30.0
    stop_file: str | None = None
    remote: bool = False
    ray_address: str | None = None
    python: str | None = None

    def __post_init__(self) -> None:
        node_range(self.nnodes)
        if self.python is not None:
            _check_interpreter_path(self.python)
        if self.timeout is not None:
            _check_seconds("timeout", self.timeout)
        _check_seconds("collective_timeout", self.collective_timeout)
        if self.hang_timeout is not None:
            _check_seconds("hang_timeout", self.hang_timeout)
        _check_seconds("stop_grace", self.stop_grace, zero_ok=True)
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        for key, value in self.env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"env must map str to str; {key!r} -> {value!r} does not")


@dataclass(frozen=True)
class LaunchResult:
    """Per-rank return values (ordered by global rank) and where the rank logs are."""

    values: list[Any]
    run_dir: Path
    log_files: dict[int, Path]
    resources: LaunchPlan
    # The global rank of each value (this node's ranks when each node launches its own).
    ranks: list[int] = field(default_factory=list)


def _print_line(rank: int, line: str) -> None:
    print(f"[rank {rank}] {line}", flush=True)


def rank_label(rank: int, options: "LaunchOptions") -> str:
    """`[rank N]`, or `[node K rank N]` when the launch spans several nodes."""
    low, high = node_range(options.nnodes)
    if high == 1:
        return f"[rank {rank}]"
    return f"[node {rank // max(1, options.gpus // high)} rank {rank}]"


@dataclass(frozen=True)
class Shipment:
    """A call ready to travel to the ranks: the pickled function and arguments, and what the
    ranks need to show the caller's source in their tracebacks."""

    name: str
    qualname: str
    payload: bytes
    code_files: list[list]
    sources: dict[str, list[str]]
    shipped: list["_CodeSpan"]
    sys_path: list[str]


def ship(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Shipment:
    """Pickle `fn(*args, **kwargs)` for the ranks (raises `PayloadError` naming what cannot)."""
    payload = _bind_payload(fn, args, kwargs)
    codes = _shipped_codes(fn)
    code_files, sources = _shipped_sources(codes)
    name = getattr(fn, "__name__", "fn")
    return Shipment(
        name=name,
        qualname=getattr(fn, "__qualname__", name),
        payload=payload,
        code_files=code_files,
        sources=sources,
        shipped=_shipped_code(codes),
        sys_path=_caller_sys_path(),
    )


def _bind_payload(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    """Pickle function and arguments, naming the first one that cannot travel."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise PayloadError(f"{name}() cannot be called with these arguments: {exc}") from exc
    except ValueError:  # builtins without a signature: let the call itself complain
        bound = None
    try:
        cloudpickle.dumps(fn)
    except Exception as exc:
        raise PayloadError(
            f"function {name} cannot be sent to the ranks (pickling failed): {exc}"
        ) from exc
    items = bound.arguments.items() if bound else enumerate((*args, *kwargs.values()))
    for arg_name, value in items:
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            raise PayloadError(
                f"argument {arg_name!r} of {name} ({type(value).__qualname__}) cannot be sent "
                f"to the ranks (pickling failed): {exc}"
            ) from exc
    return cloudpickle.dumps((fn, args, kwargs))


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


def _caller_sys_path() -> list[str]:
    return [os.path.abspath(p) if p else os.getcwd() for p in sys.path]


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


def stop_process_group(pgid: int, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """SIGTERM every live process of the group, then SIGKILL what is left after `grace_s`."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if not _wait_group_gone(pgid, grace_s):
        kill_process_group(pgid)


def _live_ranks(rd: RunDir, pgid: int) -> dict[int, int]:
    """`{rank: pid}` of this node's ranks of the latest attempt whose process still runs."""
    procs = rd.rank_processes()
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


def _dead_ranks(rd: RunDir, pgid: int) -> list[int]:
    """Ranks of the latest attempt whose process is gone without a result or an error."""
    procs = rd.rank_processes()
    attempt = max((p["attempt"] for p in procs.values()), default=0)
    live = _live_ranks(rd, pgid)
    done = {*rd.result_files(), *rd.error_files()}
    return sorted(
        r for r, p in procs.items() if p["attempt"] == attempt and r not in live and r not in done
    )


def _kill_ranks(rd: RunDir, pgid: int) -> None:
    for pid in _live_ranks(rd, pgid).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


_THREAD_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+.*:$")
_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
# What NCCL's watchdog prints before it aborts a rank whose collective timed out.
_COLLECTIVE_ABORT = re.compile(
    r"Watchdog caught collective operation timeout|ProcessGroupNCCL.*(timed out|timeout)"
)
# cloudpickle's file name for the code of a function it ships by value.
_DYNAMIC_CODE = "<dynamic-code>"
_WORKER_FILE = os.path.join("trainflow", "_worker.py")

# (function name, first line, last line, file) of code the caller shipped.
_CodeSpan = tuple[str, int, int, str]


def _shipped_codes(fn: Callable[..., Any]) -> list[types.CodeType]:
    """The code of `fn` and of the functions nested in it; with `__main__`, its module's too.

    cloudpickle ships functions from `__main__` (a script, a notebook) by value and names
    their file "<dynamic-code>", so a rank's stack would show only function and line for them.
    The caller still has the code objects, hence the files.
    """
    module = getattr(fn, "__module__", None)
    functions = [fn]
    if module == "__main__" or module not in sys.modules:  # its module travels by value too
        functions += [
            f
            for f in getattr(fn, "__globals__", {}).values()
            if isinstance(f, types.FunctionType) and f.__module__ == module
        ]
    todo = [f.__code__ for f in functions if hasattr(f, "__code__")]
    codes: list[types.CodeType] = []
    while todo:
        code = todo.pop()
        codes.append(code)
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return codes


def _shipped_code(codes: Sequence[types.CodeType]) -> list[_CodeSpan]:
    """Where shipped code (see `_shipped_codes`) is: function, first and last line, file."""
    spans: list[_CodeSpan] = []
    for code in codes:
        lines = [line for _, _, line in code.co_lines() if line is not None]
        first, last = min(lines, default=code.co_firstlineno), max(lines, default=0)
        spans.append((code.co_name, first, last, code.co_filename))
    return spans


def _shipped_sources(
    codes: Sequence[types.CodeType],
) -> tuple[list[list], dict[str, list[str]]]:
    """What a rank needs to show the source of code shipped by value in its tracebacks.

    `[name, first line, file]` of each code object, and the lines of the files a rank may not
    have: notebook cells (held in `linecache`, in no file) and the caller's script, which a
    remote worker lacks. An importable module's file is wherever the module can be imported.
    """
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    sources: dict[str, list[str]] = {}
    size = 0
    for path in dict.fromkeys(c.co_filename for c in codes):
        if os.path.isfile(path) and path != script:
            continue
        lines = linecache.getlines(path)
        size += sum(map(len, lines))
        if lines and size <= MAX_SHIPPED_SOURCE_BYTES:
            sources[path] = lines
    return [[c.co_name, c.co_firstlineno, c.co_filename] for c in codes], sources


def _shipped_file(shipped: Sequence[_CodeSpan], func: str, lineno: int) -> str | None:
    return next((f for name, a, b, f in shipped if name == func and a <= lineno <= b), None)


_TRACEBACK_DYNAMIC_FRAME = re.compile(
    rf'^(?P<indent> *)File "{_DYNAMIC_CODE}", line (?P<line>\d+), in (?P<func>.+)$', re.MULTILINE
)


def _resolve_traceback(text: str, shipped: Sequence[_CodeSpan]) -> str:
    """A rank's traceback with the caller's file and source line for code shipped by value."""

    def resolve(m: re.Match) -> str:
        lineno, func, indent = int(m["line"]), m["func"], m["indent"]
        path = _shipped_file(shipped, func, lineno)
        if path is None:
            return m[0]
        source = linecache.getline(path, lineno).strip()
        return f'{indent}File "{path}", line {lineno}, in {func}' + (
            f"\n{indent}  {source}" if source else ""
        )

    return _TRACEBACK_DYNAMIC_FRAME.sub(resolve, text)


def _format_stack_dump(text: str, shipped: Sequence[_CodeSpan] = ()) -> str | None:
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
        if path == _DYNAMIC_CODE:
            path = _shipped_file(shipped, func, lineno) or path
        out.append(f'  File "{path}", line {lineno} in {func}')
        source = linecache.getline(path, lineno).strip()
        if source:
            out.append(f"    {source}")
    return "\n".join(out)


def _dump_stacks(
    rd: RunDir, pids: dict[int, int], shipped: Sequence[_CodeSpan] = ()
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
                formatted = _format_stack_dump(data.decode("utf-8", errors="replace"), shipped)
                if formatted:
                    dumps[rank] = formatted
            seen[rank] = data
    for rank in pids:
        if rank not in dumps:
            text = seen.get(rank, b"").decode("utf-8", errors="replace")
            partial = _format_stack_dump(text, shipped)
            dumps[rank] = partial or "(no stack: the rank did not answer SIGUSR1)"
    return dumps


def _stacks_text(dumps: dict[int, str], steps: dict[int, int | None]) -> str:
    parts = []
    for rank, dump in sorted(dumps.items()):
        step = steps.get(rank)
        at = f" (last step {step})" if step is not None else ""
        parts.append(f"\n\nStack of rank {rank}{at} when it was stopped:\n{dump}")
    return "".join(parts)


class _Watchdog:
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


def _read_errors(rd: RunDir) -> dict[int, dict[str, Any]]:
    return {r: pickle.loads(p.read_bytes()) for r, p in rd.error_files().items()}


def _first_failure(errors: dict[int, dict[str, Any]]) -> int:
    return min(errors, key=lambda r: (errors[r]["time"], r))


def _shipped_cause(rec: dict[str, Any]) -> BaseException | None:
    if rec["exception"] is None:
        return None
    # The exception class may not import in the caller; the message still names it.
    try:
        return cloudpickle.loads(rec["exception"])
    except Exception:
        return None


class _LogTail:
    """Follows the per-rank log files and hands out complete lines."""

    def __init__(self, rd: RunDir, sink: LineSink):
        self.rd = rd
        self.sink = sink
        self.offsets: dict[int, int] = {}
        self.partial: dict[int, bytes] = {}
        self.progress_at: dict[int, float] = {}

    def poll(self, final: bool = False) -> None:
        for rank, path in self.rd.log_files().items():
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(rank, 0))
                    chunk = f.read()
            except FileNotFoundError:
                continue
            if not chunk and not (final and self.partial.get(rank)):
                continue
            self.offsets[rank] = self.offsets.get(rank, 0) + len(chunk)
            data = self.partial.pop(rank, b"") + chunk
            *lines, rest = data.split(b"\n")
            if final and rest:
                lines.append(rest)
                rest = b""
            for line in lines:
                # A progress bar redrawn in place (tqdm) ends as one line: its final state.
                last = next((p for p in reversed(line.split(b"\r")) if p.strip()), b"")
                self.sink(rank, last.decode("utf-8", errors="replace"))
            if rest:
                rest = self._progress(rank, rest)
                if rest:
                    self.partial[rank] = rest

    def _progress(self, rank: int, rest: bytes) -> bytes:
        """Pass on a progress bar's newest complete redraw, at most every `PROGRESS_EVERY_S`.

        Bars redraw with a carriage return and no newline until they finish, so unhandled
        they would arrive as one very long line at the end. Returns what is left to follow.
        """
        if b"\r" not in rest:
            return rest
        done, _, current = rest.rpartition(b"\r")
        newest = next((p for p in reversed(done.split(b"\r")) if p.strip()), b"")
        now = time.monotonic()
        if newest and now - self.progress_at.get(rank, -math.inf) >= PROGRESS_EVERY_S:
            self.progress_at[rank] = now
            self.sink(rank, newest.decode("utf-8", errors="replace"))
        return b"\r" + current if current else b""


def _tail(path: Path, num_lines: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(lines[-num_lines:])


def interpreter(options: LaunchOptions) -> str:
    """The Python the agent and ranks run on: `options.python`, else the caller's."""
    return os.path.abspath(options.python) if options.python else sys.executable


def rank_sys_path(sys_path: Sequence[str], python: str) -> list[str]:
    """The caller's import path as ranks running on `python` get it.

    Ranks on another interpreter (a framework's own environment) keep only the caller's own
    folders (its project, its notebook's folder): the caller's installed packages and standard
    library would shadow the versions that environment was made with.
    """
    if python == sys.executable:
        return list(sys_path)
    own = {os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix)}
    kept = []
    for entry in sys_path:
        real = os.path.realpath(entry)
        parts = real.split(os.sep)
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        if any(real == p or real.startswith(p + os.sep) for p in own):
            continue
        kept.append(entry)
    return kept


_interpreters_checked: dict[str, str] = {}


def check_interpreter(python: str) -> str:
    """Check that `python` can run our agent and ranks; return its version line.

    Run before a launch on another interpreter, so that an environment that was never made,
    or lacks torch or trainflow, fails with its name before any rank starts. Cached per
    interpreter for the life of this process.

    Raises:
        LaunchConfigError: it cannot start, naming the interpreter and the import that failed.
    """
    _check_interpreter_path(python)
    python = os.path.abspath(python)
    if python in _interpreters_checked:
        return _interpreters_checked[python]
    probe = (
        "import sys, torch, trainflow._agent, trainflow._worker; "
        "print(sys.version.split()[0], 'torch', torch.__version__)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(rank_sys_path(_caller_sys_path(), python))}
    try:
        done = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, env=env, timeout=300
        )
    except subprocess.TimeoutExpired as exc:
        raise LaunchConfigError(f"python={python}: did not start within 300 s") from exc
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        why = lines[-1] if lines else f"exit code {done.returncode}"
        raise LaunchConfigError(
            f"python={python} cannot run the ranks: {why}. "
            "Its environment needs torch, psutil, cloudpickle and trainflow itself; "
            "`bash scripts/setup-framework.sh NAME` installs them."
        )
    _interpreters_checked[python] = done.stdout.strip()
    return _interpreters_checked[python]


def _launch_env(
    options: LaunchOptions, res: LaunchPlan, sys_path: Sequence[str] | None = None
) -> dict[str, str]:
    """What the agent and its ranks get on top of the caller's environment.

    `sys_path`: the ranks' import path (`rank_sys_path`); None: the caller's, as ranks on
    `options`' interpreter get it.
    """
    python = interpreter(options)
    if sys_path is None:
        sys_path = rank_sys_path(_caller_sys_path(), python)
    env = {
        "PYTHONUNBUFFERED": "1",
        "TRAINFLOW_DEVICE": res.device,
        "PYTHONPATH": os.pathsep.join(sys_path),
    }
    if python != sys.executable:
        # What activating that environment would do: a rank that starts `python` or a
        # framework's own command (`accelerate`, `composer`) gets that environment's.
        bin_dir = os.path.dirname(python)
        env["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", os.defpath)])
        env["VIRTUAL_ENV"] = os.path.dirname(bin_dir)
    if res.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # what torchrun does, to avoid oversubscription
    if res.device == "cpu":
        # What accelerate (the Hugging Face Trainer) and DeepSpeed read to run as CPU ranks;
        # without them the Trainer trains alone on each rank.
        env.update(CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="true", DS_ACCELERATOR="cpu")
    env.update(options.env)
    return env


def _start_method(res: LaunchPlan) -> str:
    """fork on CPU: ranks start ~2x sooner, as torch is already imported in the agent.

    spawn on GPUs, the method torch recommends with CUDA, where start-up time is small next
    to training. TRAINFLOW_START_METHOD overrides either.
    """
    method = os.environ.get(START_METHOD_ENV) or ("fork" if res.device == "cpu" else "spawn")
    if method not in ("fork", "spawn", "forkserver"):
        raise LaunchConfigError(f"{START_METHOD_ENV}={method!r}: use fork, spawn or forkserver")
    return method


class _Standby:
    """An agent started before its launch is asked for, importing what the ranks will need.

    A pipeline knows how it will train (the ranks' environment, the workload's modules) long
    before it launches: it still prepares data and opens its MLflow run. An agent started then
    imports torch's elastic agent and the workload's modules meanwhile, and its ranks, forked
    from it, start with them loaded (on CPU ranks; spawned GPU ranks import their own).

    The launch whose environment, working directory and start method are the ones it was
    started with claims it (`_claim_standby`); otherwise it is discarded. It exits with the
    process that started it, like any agent.
    """

    def __init__(
        self,
        env: dict[str, str],
        start_method: str,
        preload: Sequence[str],
        python: str,
        calls: Sequence[tuple[str, Any]] = (),
    ):
        self.env = env  # what the launch adds to the caller's environment
        self.python = python
        self.cwd = os.getcwd()
        self.start_method = start_method
        # Its output until a launch claims it (then it goes to that launch's agent log): in
        # the temp folder, as no launch folder exists yet.
        prefix = f"trainflow-standby-{os.getpid()}-"
        fd, log_path = tempfile.mkstemp(prefix=prefix, suffix=".log")
        os.close(fd)
        self.log = Path(log_path)
        self.calls = list(calls)
        self.request: Path | None = None
        self.outputs: list[Path] = []
        self.outcomes: dict[int, dict[str, Any] | None] = {}  # once read
        checking: list[str] = []
        if self.calls:
            fd, request = tempfile.mkstemp(prefix=prefix, suffix=".check.json")
            self.request = Path(request)
            self.outputs = [self.request.with_suffix(f".{i}.out") for i in range(len(self.calls))]
            spec = [
                {"function": function, "argument": argument, "output": str(output)}
                for (function, argument), output in zip(self.calls, self.outputs, strict=True)
            ]
            with os.fdopen(fd, "w") as file:
                json.dump(spec, file)
            checking = ["--check", request]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [python, "-m", "trainflow._agent", "--standby", str(self.log), *checking, *preload],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **env},
            )

    def fits(self, env: dict[str, str], start_method: str, python: str) -> bool:
        return (
            self.proc.poll() is None
            and env == self.env
            and python == self.python
            and start_method == self.start_method
            and os.getcwd() == self.cwd
        )

    def claim(self, rd: RunDir) -> subprocess.Popen:
        """Hand the agent its launch folder and the caller's environment as it is now (MLflow
        and Prefect set theirs meanwhile); it runs that launch from here on. The environment
        goes through the pipe, never to disk: it can hold tokens."""
        assert self.proc.stdin is not None
        message = {"run_dir": str(rd.path), "env": {**os.environ, **self.env}}
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.close()
        return self.proc

    def outcome(self, index: int, poll_s: float = 0.05) -> dict[str, Any] | None:
        """The outcome of call `index` of those this agent runs before its imports (see
        `trainflow._agent.run_calls`), waited for; None if the agent exited before it wrote
        one, or skipped it after an earlier call's refusal (the caller then does it itself)."""
        if index in self.outcomes:
            return self.outcomes[index]
        output = self.outputs[index]
        while not output.exists():
            if self.proc.poll() is not None and not output.exists():
                return None
            time.sleep(poll_s)
        outcome = json.loads(output.read_text())
        output.unlink(missing_ok=True)
        self.outcomes[index] = None if "skipped" in outcome else outcome
        if len(self.outcomes) == len(self.calls) and self.request is not None:
            self.request.unlink(missing_ok=True)
        return self.outcomes[index]

    def _remove_check_files(self) -> None:
        for path in [*self.outputs, *([self.request] if self.request else [])]:
            path.unlink(missing_ok=True)

    def discard(self, grace_s: float = 3.0) -> None:
        """Stop the agent: SIGTERM, which lets a call it runs ahead clean up (a dataset's
        staging folder), then SIGKILL to what is left of its group after `grace_s`."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        kill_process_group(self.proc.pid)
        self.proc.wait()
        self.log.unlink(missing_ok=True)
        self._remove_check_files()


_standbys: list[_Standby] = []
_standbys_lock = threading.Lock()


class AgentAhead:
    """What `standby` returns: call it to stop the agent if no launch has used it;
    `check_outcome()` waits for the check it was asked to run ahead, `outcome(call)` for any
    of the calls."""

    def __init__(self, agent: _Standby | None = None, check: tuple[str, Any] | None = None) -> None:
        self._agent = agent
        self._check = check

    def __call__(self) -> None:
        agent = self._agent
        if agent is None:
            return
        with _standbys_lock:
            if agent not in _standbys:
                return  # claimed
            _standbys.remove(agent)
        agent.discard()

    def check_outcome(self) -> dict[str, Any] | None:
        """The outcome of the check: see `outcome`."""
        return None if self._check is None else self.outcome(self._check)

    def outcome(self, call: tuple[str, Any]) -> dict[str, Any] | None:
        """The outcome of `call`, one of those the agent was asked to run ahead
        (`trainflow._agent.run_calls`): `value`, `refused` or `failed`. None when no agent ran
        it (none was started: a remote launch, TRAINFLOW_STANDBY=0; an agent started earlier
        for other calls; an agent that exited first, or skipped it after an earlier call's
        refusal): the caller does it itself."""
        agent = self._agent
        if agent is None or call not in agent.calls:
            return None
        return agent.outcome(agent.calls.index(call))


def standby(
    options: LaunchOptions,
    preload: Sequence[str] = (),
    check: tuple[str, Any] | None = None,
    then: Sequence[tuple[str, Any]] = (),
) -> AgentAhead:
    """Start the agent of a launch with `options` now, importing `preload` (module names).

    The next `launch` with the same options in this process and working directory uses it
    (any thread); a launch with other options starts its own. An unused agent for the same
    options already waiting is kept instead of starting another. Returns a call that stops the
    agent if no launch has used it (call it when the launch will not come, e.g. when the
    pipeline ends). Nothing happens for remote launches, or with TRAINFLOW_STANDBY=0.

    `check`, (`module:function`, a JSON value): a check the agent runs once its imports are
    done, before any launch claims it, where the workload's libraries are loaded (the model
    built on the meta device, a config read with transformers): the caller's process need not
    import them. `AgentAhead.check_outcome` gives what it found. `then`: more such calls, run
    in order after the check and before the imports (an SFT run's dataset, prepared where
    `datasets` and `streaming` will be imported anyway); `AgentAhead.outcome(call)` gives each
    one's outcome. After a call that does not return a value, the rest are skipped.

    A process that leads follower nodes (`trainflow.follow`) starts its launch board here for a
    multi-node launch, TRAINFLOW_STANDBY=0 or not: its followers wait for it.
    """
    if options.remote or ray_cluster_address(options.nnodes, options.ray_address):
        return AgentAhead()  # the ranks run elsewhere
    # A leader's followers wait for its launch board: it comes up with the pipeline.
    _launch_board(options)
    if os.environ.get(STANDBY_ENV) == "0":
        return AgentAhead()
    res = resolve_resources(options.gpus, options.gpu_type, options.nnodes)
    env, method, python = _launch_env(options, res), _start_method(res), interpreter(options)
    with _standbys_lock:
        agent = next((a for a in _standbys if a.fits(env, method, python)), None)
        if agent is None:
            calls = [*([check] if check is not None else []), *then]
            agent = _Standby(env, method, preload, python, calls)
            _standbys.append(agent)
    return AgentAhead(agent, check)


def discard_standbys() -> None:
    """Stop every agent this process started ahead that no launch has used."""
    with _standbys_lock:
        unused = list(_standbys)
        _standbys.clear()
    for agent in unused:
        agent.discard()


def _claim_standby(
    env: dict[str, str], start_method: str, python: str, rd: RunDir
) -> subprocess.Popen | None:
    """The process of a standby agent that fits this launch, now running it; else None."""
    with _standbys_lock:
        for agent in _standbys:
            if agent.fits(env, start_method, python):
                _standbys.remove(agent)
                return agent.claim(rd)
    return None


class _Launch:
    """One supervised launch: plan, start, watch, stop, collect."""

    def __init__(
        self,
        fn: Callable[..., Any] | None,
        options: LaunchOptions,
        sink: LineSink,
        rendezvous: tuple[str, str, bool] | None = None,
    ):
        """`rendezvous`: (endpoint, run id, whether this node hosts the store), given by a
        launcher that places the nodes itself (`trainflow.ray_launcher`)."""
        self.fn = fn
        self.options = options
        self.sink = sink
        self.name = getattr(fn, "__name__", "fn")
        self.rendezvous = rendezvous

    def _rendezvous(self) -> tuple[str, str]:
        if self.rendezvous is not None:
            return self.rendezvous[0], self.rendezvous[1]
        if node_range(self.options.nnodes) == (1, 1):
            return "127.0.0.1:0", uuid.uuid4().hex
        endpoint, run_id = os.environ.get(RDZV_ENDPOINT_ENV), os.environ.get(RUN_ID_ENV)
        if not endpoint or not run_id:
            raise LaunchConfigError(
                f"nnodes={self.options.nnodes} needs a rendezvous shared by all nodes: set "
                f"{RDZV_ENDPOINT_ENV}=host:port (reachable from every node) and {RUN_ID_ENV} "
                "to the same value on each node, then call .distributed() on every node"
            )
        return endpoint, run_id

    def run(self, args: tuple, kwargs: dict) -> LaunchResult:
        assert self.fn is not None
        return self.run_shipment(ship(self.fn, args, kwargs))

    def run_shipment(self, shipment: Shipment) -> LaunchResult:
        opts = self.options
        self.name = shipment.name
        res = resolve_resources(opts.gpus, opts.gpu_type, opts.nnodes)
        prune_run_dirs(trainflow_home() / "runs", keep_run_dirs())
        endpoint, run_id = self._rendezvous()
        python = interpreter(opts)
        if opts.python is not None:
            check_interpreter(python)  # a missing or broken environment fails before any rank
        sys_path = rank_sys_path(shipment.sys_path, python)
        env = _launch_env(opts, res, sys_path)
        start_method = _start_method(res)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        rd = RunDir(trainflow_home() / "runs" / f"{stamp}-{self.name}-{uuid.uuid4().hex[:8]}")
        rd.create(
            {
                "function": shipment.qualname,
                "run_id": run_id,
                "rdzv_endpoint": endpoint,
                "rdzv_timeout_s": int(opts.timeout) if opts.timeout else 900,
                "rdzv_is_host": self.rendezvous[2] if self.rendezvous else None,
                "nnodes": res.nnodes,
                "min_nodes": res.min_nodes or res.nnodes,
                "nproc_per_node": res.nproc_per_node,
                "device": res.device,
                "max_restarts": opts.max_restarts,
                # The agent's own SIGTERM-to-SIGKILL grace for the workers, when it is stopped
                # from outside (a node shutdown) rather than by this caller.
                "shutdown_timeout_s": opts.stop_grace,
                "collective_timeout_s": opts.collective_timeout,
                "hang_timeout_s": opts.hang_timeout,
                "init_process_group": opts.init_process_group,
                "start_method": start_method,
                "sys_path": sys_path,
                "python": python,
                "code_files": shipment.code_files,
                # Names only: values (tokens, keys) travel in the agent's environment and are
                # never written to disk.
                "env_names": sorted(env),
                "caller_pid": os.getpid(),
            },
            shipment.payload,
            shipment.sources,
        )
        self._announce(rd, res)
        self._tail = _LogTail(rd, self.sink)
        self._gone_at_failure: list[int] = []
        self.shipped = shipment.shipped
        proc = _claim_standby(env, start_method, python, rd)
        if proc is None:
            with open(rd.agent_log, "wb") as agent_log:
                proc = subprocess.Popen(
                    [python, "-m", "trainflow._agent", str(rd.path)],
                    stdin=subprocess.DEVNULL,
                    stdout=agent_log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, **env},
                )
        verdict: LaunchError | None = None
        try:
            try:
                verdict = self._supervise(proc, rd, res)
            except BaseException:
                self._stop_gracefully(proc.pid, rd)
                raise
            finally:
                # Hung ranks cannot act on SIGTERM: no grace for them.
                stop_process_group(
                    proc.pid, 0.0 if isinstance(verdict, HangError) else SHUTDOWN_GRACE_S
                )
                proc.wait()
            self._tail.poll(final=True)
            if verdict is not None:
                raise verdict
            return self._collect(proc.returncode, rd, res)
        finally:
            adapted = read_adaptations(rd.path)
            if adapted:
                logger.warning(
                    "%s.distributed() ran on CPU ranks with these adaptations: %s",
                    self.name,
                    "; ".join(adapted),
                )
            rd.discard_payloads()  # on every path, Ctrl-C included

    def _announce(self, rd: RunDir, res: LaunchPlan) -> None:
        text = (
            f"{self.name}.distributed(): {res.world_size} {res.device} rank(s) on "
            f"{res.nnodes} node(s); rank logs in {rd.logs}"
        )
        logger.info(text)
        if self.sink is _print_line:  # a terminal or notebook: say where the logs are
            print(f"[trainflow] {text}", flush=True)

    def _stop_gracefully(self, pgid: int, rd: RunDir) -> None:
        """The caller was interrupted: SIGTERM the launch, wait up to `stop_grace`, then kill.

        Ranks only note the SIGTERM; at the end of their step `runtime.should_stop()` says so
        on every rank, and they write a final checkpoint and end. The agent, stopped by the
        same signal, waits as long for them (its `shutdown_timeout`). The wait ends early once
        no rank still runs its function: a rank that has returned only waits for the agent to
        collect its value, which a stopping agent never does. A second Ctrl-C ends it at once.
        Ranks that never asked `should_stop()` cannot act on the request: they get the short
        `SHUTDOWN_GRACE_S` instead.
        """
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        grace = self.options.stop_grace
        if not self._ranks_check_stops(rd):
            grace = min(grace, SHUTDOWN_GRACE_S)
        deadline = time.monotonic() + grace
        try:
            while time.monotonic() < deadline and self._ranks_working(rd, pgid):
                self._tail.poll()
                time.sleep(0.1)
            self._tail.poll()
        except KeyboardInterrupt:
            pass  # asked twice: stop waiting
        finally:
            kill_process_group(pgid)

    @staticmethod
    def _ranks_check_stops(rd: RunDir) -> bool:
        """Whether a rank of the latest attempt has asked `runtime.should_stop()`."""
        attempt = max((p["attempt"] for p in rd.rank_processes().values()), default=0)
        return any(c["attempt"] == attempt for c in rd.stop_checks().values())

    @staticmethod
    def _ranks_working(rd: RunDir, pgid: int) -> bool:
        """Whether a rank of the latest attempt still runs its function."""
        finished = {**rd.result_files(), **rd.error_files()}
        for rank in _live_ranks(rd, pgid):
            try:
                started = (rd.ranks / f"rank_{rank}.pid").stat().st_mtime_ns
                # An earlier attempt's error record does not count.
                if finished[rank].stat().st_mtime_ns < started:
                    return True
            except (KeyError, FileNotFoundError):
                return True
        return False

    def _supervise(self, proc: subprocess.Popen, rd: RunDir, res: LaunchPlan) -> LaunchError | None:
        """Stream logs until the agent exits; stop on timeout, a hang or a lingering failure.

        Returns the error to raise once every process is stopped (a timeout, a hang, peers
        that stopped answering), or None when the ranks' results and errors tell the story.
        """
        opts = self.options
        deadline = time.monotonic() + opts.timeout if opts.timeout else None
        watchdog = (
            _Watchdog(rd, opts.hang_timeout, res.nproc_per_node) if opts.hang_timeout else None
        )
        pgid = proc.pid
        next_watch = 0.0
        failed_at: float | None = None  # first sign of a failed rank: an error, or a death
        errors_seen = survivors_killed = False
        grace = FAILURE_GRACE_S
        restarted_after = -1  # the last attempt whose survivors were stopped for a restart
        try:
            while proc.poll() is None:
                self._tail.poll()
                now = time.monotonic()
                watch = now >= next_watch
                if watch:
                    next_watch = now + WATCH_EVERY_S
                # With restarts allowed, a failed attempt is the elastic agent's call to make;
                # only its survivors are stopped, so that it restarts at once.
                if opts.max_restarts > 0 and watch:
                    restarted_after = self._stop_failed_attempt(rd, pgid, restarted_after)
                if opts.max_restarts == 0:
                    if not errors_seen and rd.error_files():
                        errors_seen = True
                        failed_at = failed_at or now
                        silent = self._peers_that_stopped_answering(rd, pgid)
                        if silent is not None:
                            return silent
                        grace = self._after_rank_error(rd, pgid)
                    elif failed_at is None and watch and (dead := _dead_ranks(rd, pgid)):
                        failed_at = now
                        silent = self._peers_of_a_collective_abort(rd, pgid, dead)
                        if silent is not None:
                            return silent
                    elif (
                        failed_at is not None
                        and not errors_seen
                        and not survivors_killed
                        and now - failed_at > LOST_RANK_GRACE_S
                    ):
                        _kill_ranks(rd, pgid)  # a rank died without a Python error
                        survivors_killed = True
                if failed_at is not None and now - failed_at > grace:
                    return None
                if deadline is not None and now > deadline:
                    return self._timeout_error(rd, res)
                if watchdog is not None and failed_at is None and watch and watchdog.stalled(now):
                    return self._hang_error(rd, pgid, watchdog)
                if opts.stop_file and watch and os.path.exists(opts.stop_file):
                    self._stop_gracefully(pgid, rd)
                    return StopRequested(
                        f"stopped on request ({opts.stop_file} appeared); the ranks "
                        f"checkpointed at the step they reached. Rank logs: {rd.logs}",
                        log_dir=str(rd.logs),
                    )
                time.sleep(0.05)
            return None
        finally:
            self._tail.poll()

    def _after_rank_error(self, rd: RunDir, pgid: int) -> float:
        """A rank raised: stop the others now; return how long the agent then gets to end.

        Torch stops the surviving workers with SIGTERM and waits 30 s for them to exit; our
        ranks only note a SIGTERM, and survivors of a failure never reach the end of their
        step, so they are killed here, as that SIGTERM used to do. Unless the rank stopped on
        request (`Preempted`): its peers are finishing the same final checkpoint and get
        `stop_grace`.
        """
        errors = _read_errors(rd)
        if errors[_first_failure(errors)]["type"] == _PREEMPTED_TYPE:
            return max(FAILURE_GRACE_S, self.options.stop_grace)
        _kill_ranks(rd, pgid)
        return FAILURE_GRACE_S

    @staticmethod
    def _stop_failed_attempt(rd: RunDir, pgid: int, stopped: int) -> int:
        """With restarts: once a rank of the current attempt failed, kill the others.

        What `_after_rank_error` does without restarts, for the elastic agent, which waits
        30 s on survivors before it restarts. Returns the attempt now handled.
        """
        procs = rd.rank_processes()
        attempt = max((p["attempt"] for p in procs.values()), default=0)
        if attempt == stopped:
            return stopped
        started = {}
        for rank, rec in procs.items():
            if rec["attempt"] == attempt:
                with contextlib.suppress(FileNotFoundError):
                    started[rank] = (rd.ranks / f"rank_{rank}.pid").stat().st_mtime_ns
        errors = {}
        for rank, path in rd.error_files().items():
            with contextlib.suppress(FileNotFoundError, EOFError, pickle.UnpicklingError):
                if rank in started and path.stat().st_mtime_ns >= started[rank]:
                    errors[rank] = pickle.loads(path.read_bytes())
        if errors:
            if errors[_first_failure(errors)]["type"] == _PREEMPTED_TYPE:
                return stopped  # the others are finishing the same final checkpoint
        elif not _dead_ranks(rd, pgid):
            return stopped
        _kill_ranks(rd, pgid)
        return attempt

    @staticmethod
    def _expected_ranks(rd: RunDir, res: LaunchPlan) -> list[int]:
        return list(range(res.nproc_per_node)) if res.nnodes == 1 else sorted(rd.log_files())

    def _timeout_error(self, rd: RunDir, res: LaunchPlan) -> LaunchTimeoutError:
        expected = self._expected_ranks(rd, res)
        results = rd.result_files()
        running = [r for r in expected if r not in results] or expected
        return LaunchTimeoutError(
            f"{self.name}.distributed() timed out after {self.options.timeout:g}s; "
            f"rank(s) {', '.join(map(str, running))} still running were stopped. "
            f"Rank logs: {rd.logs}",
            running_ranks=running,
            log_dir=str(rd.logs),
        )

    def _hang_error(self, rd: RunDir, pgid: int, watchdog: _Watchdog) -> HangError:
        """No rank advanced for `hang_timeout`: name every rank's last step, show the stacks.

        Ranks in step with each other wait for one another in a collective; a rank behind the
        others is the one they wait for, so its stack is the one shown.
        """
        beats = dict(sorted(watchdog.beats.items()))
        steps: dict[int, int | None] = {r: b["step"] for r, b in beats.items()}
        low, high = min(beats[r]["step"] for r in beats), max(beats[r]["step"] for r in beats)
        stuck = [r for r in beats if beats[r]["step"] == low]
        live = _live_ranks(rd, pgid)
        stacks = _dump_stacks(rd, {r: live[r] for r in stuck if r in live}, self.shipped)
        now = time.time()
        where = ", ".join(
            f"rank {r} at step {b['step']} (last beat {now - b['time']:.0f}s ago)"
            for r, b in beats.items()
        )
        behind = (
            f"\n{_ranks_text(stuck)} fell behind at step {low} while others reached step "
            f"{high}: the others wait for {'it' if len(stuck) == 1 else 'them'}."
            if low != high
            else ""
        )
        return HangError(
            f"{self.name}.distributed() hung: no rank's heartbeat advanced for "
            f"{self.options.hang_timeout:g}s (hang_timeout); every rank was stopped. "
            f"Last steps: {where}.{behind}"
            + _stacks_text(stacks, steps)
            + f"\n\nRank logs: {rd.logs}",
            stuck_ranks=stuck,
            last_steps=steps,
            log_dir=str(rd.logs),
        )

    def _peers_that_stopped_answering(self, rd: RunDir, pgid: int) -> HangError | None:
        """A rank raised waiting for its peers: are some of them alive but silent?

        Those peers, not the rank that noticed, are where the launch is stuck: they get the
        blame and their stacks are dumped before anything is stopped. Peers already dead are
        noted for `_collect`.
        """
        errors = _read_errors(rd)
        first = _first_failure(errors)
        rec = errors[first]
        if not is_collective_failure(rec["type"], rec["message"]):
            return None
        self._gone_at_failure = _dead_ranks(rd, pgid)
        error = self._silent_peers_error(
            rd,
            pgid,
            first,
            f"{rec['type_name']}: {first_line(rec['message'])}",
            f"Traceback from rank {first}:\n{self._traceback(rec)}",
        )
        if error is not None:
            error.__cause__ = _shipped_cause(rec)
        return error

    def _peers_of_a_collective_abort(
        self, rd: RunDir, pgid: int, dead: list[int]
    ) -> HangError | None:
        """Ranks died without a Python error: did one abort on a collective timeout?

        NCCL's watchdog ends a rank whose collective timed out (SIGABRT), so no exception
        reaches the worker; the rank's log still has the watchdog's line.
        """
        for rank in dead:
            lines = _tail(rd.log_path(rank), 40).splitlines()
            line = next((x for x in reversed(lines) if _COLLECTIVE_ABORT.search(x)), None)
            if line is not None:
                return self._silent_peers_error(
                    rd,
                    pgid,
                    rank,
                    line.strip(),
                    f"Last lines of rank {rank}:\n" + "\n".join(lines[-15:]),
                )
        return None

    def _silent_peers_error(
        self, rd: RunDir, pgid: int, first: int, failure: str, evidence: str
    ) -> HangError | None:
        """Rank `first` failed in a collective with `failure`: blame the peers still alive."""
        done = {*rd.result_files(), *rd.error_files(), first}
        silent = {r: pid for r, pid in _live_ranks(rd, pgid).items() if r not in done}
        if not silent:
            return None
        stacks = _dump_stacks(rd, silent, self.shipped)
        failed = set(rd.error_files())  # a peer may have failed on its own meanwhile
        stuck = sorted(r for r in silent if r not in failed)
        if not stuck:
            return None
        beats = rd.heartbeats()
        steps = {r: beats[r]["step"] if r in beats else None for r in stuck}
        them = "it" if len(stuck) == 1 else "them"
        if re.search(r"timed? ?out|timeout", failure, re.IGNORECASE):
            ms = re.search(r"Timeout\(ms\)=(\d+)|(\d+)\s*ms\b", failure)
            waited = (
                f"{int(ms[1] or ms[2]) / 1000:g}s"
                if ms
                else f"{self.options.collective_timeout:g}s"
            )
            how = f"rank {first} timed out after {waited} waiting for {them} in a collective"
        else:
            how = f"rank {first} failed waiting for {them} in a collective"
        return HangError(
            f"{_ranks_text(stuck)} stopped answering: {how} ({failure}); every rank was stopped."
            + _stacks_text(stacks, steps)
            + f"\n\n{evidence}"
            + f"\n\nRank logs: {rd.logs}",
            stuck_ranks=stuck,
            last_steps=steps,
            log_dir=str(rd.logs),
        )

    def _collect(self, returncode: int, rd: RunDir, res: LaunchPlan) -> LaunchResult:
        log_dir = str(rd.logs)
        errors = _read_errors(rd)
        results = rd.result_files()
        expected = self._expected_ranks(rd, res)
        missing = [r for r in expected if r not in results]
        if errors and (returncode != 0 or missing):
            gone = [r for r in self._gone_at_failure if r not in errors]
            if gone:
                raise self._lost_peer_error(gone, errors, log_dir)
            raise self._rank_error(errors, log_dir)
        if returncode != 0 or missing or not results:
            detail = rd.agent_error.read_text() if rd.agent_error.exists() else ""
            detail = detail or _tail(rd.agent_log)
            logs = "\n".join(
                f"--- rank {r} (last lines) ---\n{_tail(p, 15)}" for r, p in rd.log_files().items()
            )
            raise LaunchError(
                f"{self.name}.distributed() failed (agent exit code {returncode}); "
                f"rank(s) without a result: {missing or 'all'}.\n{detail}\n{logs}\n"
                f"Rank logs: {log_dir}",
                log_dir=log_dir,
            )
        values = [cloudpickle.loads(results[r].read_bytes()) for r in sorted(results)]
        return LaunchResult(values, rd.path, rd.log_files(), res, sorted(results))

    def _traceback(self, rec: dict[str, Any]) -> str:
        return _resolve_traceback(rec["traceback"], self.shipped).rstrip()

    def _lost_peer_error(
        self, gone: list[int], errors: dict[int, dict], log_dir: str
    ) -> LaunchError:
        """Peers died without a Python error, and a rank then failed in a collective.

        The agent's own summary would name that rank as the root cause: it saw its exit code
        first. The peers' processes were already gone when the rank failed.
        """
        first = _first_failure(errors)
        rec = errors[first]
        error = LaunchError(
            f"{_ranks_text(gone)} died without a Python error (killed by a signal: SIGKILL, "
            f"the OOM killer, ...); rank {first} then failed in a collective with "
            f"{rec['type_name']}: {first_line(rec['message'])}"
            f"\n\nTraceback from rank {first}:\n{self._traceback(rec)}"
            f"\n\nRank logs: {log_dir}",
            log_dir=log_dir,
        )
        error.__cause__ = _shipped_cause(rec)
        return error

    def _rank_error(self, errors: dict[int, dict], log_dir: str) -> RankError:
        first = _first_failure(errors)
        rec = errors[first]
        others = sorted(r for r in errors if r != first)
        message = (
            f"rank {first} failed while {rec['where']} with {rec['type_name']}: {rec['message']}"
            + (f"\n(failed after it: rank {', '.join(map(str, others))})" if others else "")
            + f"\n\nTraceback from rank {first}:\n{self._traceback(rec)}"
            + f"\n\nRank logs: {log_dir}"
        )
        error = RankError(
            message,
            rank=first,
            exc_type=rec["type"],
            remote_traceback=_resolve_traceback(rec["traceback"], self.shipped),
            failed_ranks=sorted(errors),
            log_dir=log_dir,
            remote_message=rec["message"],
        )
        error.__cause__ = _shipped_cause(rec)
        return error


def launch(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    options: LaunchOptions,
    on_line: LineSink | None = None,
) -> LaunchResult:
    """Run `fn(*args, **kwargs)` on every rank and return all results with the run's log files.

    Args:
        fn: Any picklable callable (functions from `__main__`, closures and lambdas included).
        args: Positional arguments, shipped to every rank.
        kwargs: Keyword arguments, shipped to every rank.
        options: Resources, timeout, restarts and environment for the launch.
        on_line: Called with `(rank, line)` for every line a rank prints; by default lines are
            printed with a `[rank N]` prefix.

    Raises:
        ResourceError: the requested GPUs are not on this machine (nothing started).
        PayloadError: the function or an argument cannot be pickled (nothing started).
        RankError: a rank raised; names the first failing rank, with its traceback.
        LaunchTimeoutError: the launch ran past `options.timeout`; names the ranks stopped.
        HangError: no rank advanced for `options.hang_timeout`, or ranks stopped answering
            their peers in a collective; names them, with their stacks.
        LaunchError: the agent or a rank died without a Python error (signal, OOM, ...).

    Interrupted (KeyboardInterrupt or any other exception raised in this thread while it
    waits), it gives the ranks `options.stop_grace` seconds to stop cleanly, kills what is
    left and re-raises.
    """
    from trainflow import ray_launcher

    if ray_launcher.ray_address(options):
        return ray_launcher.launch(
            fn, tuple(args), dict(kwargs or {}), options=options, on_line=on_line
        )
    board = _launch_board(options)
    if board is not None:
        from trainflow import follow

        return follow.lead(board, fn, tuple(args), dict(kwargs or {}), options, on_line)
    return _Launch(fn, options, on_line or _print_line).run(tuple(args), dict(kwargs or {}))


def _launch_board(options: LaunchOptions) -> Any:
    """The launch board this process hosts for follower nodes (`trainflow.follow`), for a
    multi-node launch that no Ray cluster places; None otherwise, or when not enabled."""
    if node_range(options.nnodes)[1] == 1 or ray_cluster_address(
        options.nnodes, options.ray_address
    ):
        return None
    from trainflow import follow

    return follow.leader_board()


class DistributedFunction(Generic[P, R]):
    """A function that runs in-process when called and on every rank via `.distributed()`."""

    def __init__(self, fn: Callable[P, R], options: LaunchOptions):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(*args, **kwargs)

    def distributed(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run on every rank; return the per-rank return values ordered by global rank.

        Inside a Prefect flow run the launch is its own task run and rank output goes to the
        run's logs; elsewhere rank output is printed with a `[rank N]` prefix.
        """
        if self.options.remote:
            deployment = remote_deployment(self.options.gpu_type)  # fails before anything runs
            payload = _bind_payload(self.fn, args, kwargs)
            from trainflow import prefect_adapter

            return prefect_adapter.run_remote(deployment, payload, self.options)
        if "prefect" in sys.modules:
            from trainflow import prefect_adapter

            if prefect_adapter.in_prefect_run():
                return prefect_adapter.launch_in_prefect(self.fn, args, kwargs, self.options).values
        return launch(self.fn, args, kwargs, options=self.options).values

    def __reduce__(self) -> Any:
        # Ship the plain function: ranks call it directly.
        return (_rebuild, (self.fn, self.options))


def remote_deployment(gpu_type: str | None) -> str:
    """The Prefect deployment a `remote=True` call runs on, for this GPU type.

    TRAINFLOW_REMOTE_DEPLOYMENT_<GPU TYPE> (e.g. `_H100`) first, then
    TRAINFLOW_REMOTE_DEPLOYMENT; each names a deployment of `flows/remote.py:remote_call`
    ("remote-call/h100") on a work pool whose workers have those GPUs.

    Raises:
        RemoteNotConfiguredError: neither is set; says how to set one up.
    """
    suffix = re.sub(r"[^A-Z0-9]+", "_", (gpu_type or "").upper()).strip("_")
    names = ([f"{REMOTE_DEPLOYMENT_ENV}_{suffix}"] if suffix else []) + [REMOTE_DEPLOYMENT_ENV]
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    raise RemoteNotConfiguredError(
        f"remote=True needs a Prefect deployment to run the call on, and none is configured: "
        f"set {' or '.join(names)} to the name of a deployment of "
        "flows/remote.py:remote_call (e.g. 'remote-call/h100') on a work pool with "
        f"{gpu_type or 'GPU'} workers. `prefect deploy --name remote-call/cpu-local` creates one "
        "from prefect.yaml; see docs/notebooks.md. Or use remote=False to run the ranks here."
    )


def _rebuild(fn: Callable[..., Any], options: LaunchOptions) -> DistributedFunction:
    return DistributedFunction(fn, options)


def distributed(
    gpus: int,
    gpu_type: str | None = None,
    *,
    nnodes: int | str = 1,
    timeout: float | None = None,
    init_process_group: bool = False,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    collective_timeout: float = 600.0,
    hang_timeout: float | None = None,
    stop_grace: float = 30.0,
    stop_file: str | None = None,
    remote: bool = False,
    ray_address: str | None = None,
    python: str | None = None,
) -> Callable[[Callable[P, R]], DistributedFunction[P, R]]:
    """Decorate a function so `fn.distributed(...)` runs it on `gpus` ranks.

    Args:
        gpus: Total number of ranks across all nodes (one GPU each when on GPUs).
        gpu_type: None uses what the machine has (GPUs, else CPU ranks with gloo); "cpu" forces
            CPU ranks; a GPU name ("H100", "A10") must match the GPUs present, unless
            TRAINFLOW_CPU_FALLBACK=1, which runs CPU ranks with a warning.
        nnodes: Number of nodes, or an elastic range "min:max". With more than one and a Ray
            cluster (`ray_address`, or RAY_ADDRESS), the call places every node on the cluster
            and returns all ranks' values (`trainflow.ray_launcher`). Without Ray, call
            `.distributed()` on every node with TRAINFLOW_RDZV_ENDPOINT and TRAINFLOW_RUN_ID set
            alike; each node returns the values of its own ranks. Or call it on the first node
            only, with TRAINFLOW_LAUNCH_BOARD set too, and run `python -m trainflow.follow` on
            the others (`trainflow.follow`); the call returns the first node's values.
        timeout: Seconds for the whole call; past it every rank is stopped and
            `LaunchTimeoutError` names the ranks still running.
        init_process_group: Initialise the default process group (gloo on CPU, nccl on CUDA
            with the device bound to LOCAL_RANK) before the function and destroy it after.
        max_restarts: Times torch elastic restarts all ranks after a failure.
        env: Extra environment variables for every rank.
        collective_timeout: Seconds a rank waits for its peers in one collective before it
            fails (the timeout of `runtime.init_process_group`'s group); the launch then
            names the peers that stopped answering, with their stacks.
        hang_timeout: With ranks calling `runtime.heartbeat(step)`: when no rank advanced for
            this many seconds, every rank is stopped and `HangError` names each rank's last
            step and where it is stuck. None: no watchdog.
        stop_grace: Seconds the ranks get to write a final checkpoint when the caller is
            interrupted (Ctrl-C, a cancel) before they are killed; a second Ctrl-C kills at
            once. Also the agent's own grace when it is sent SIGTERM from outside.
        stop_file: A path another process may create to stop the launch as a preemption
            would (a final checkpoint, then the ranks end, within `stop_grace`); the call then
            raises `StopRequested`, which is not retried.
        remote: False runs the ranks on this machine. True submits the call to the Prefect
            deployment configured for `gpu_type` (TRAINFLOW_REMOTE_DEPLOYMENT_<TYPE> or
            TRAINFLOW_REMOTE_DEPLOYMENT, a deployment of `flows/remote.py:remote_call`), waits
            for it and returns its per-rank results; `RemoteNotConfiguredError` when none is
            set.
        ray_address: A Ray cluster ("ray://head:10001", "auto", "host:6379") to place the
            nodes on, even for one node; None: RAY_ADDRESS when `nnodes` is above 1.
        python: The interpreter of another virtual environment (a framework that cannot share
            this one, e.g. `.venvs/axolotl/bin/python`) to run the agent and ranks on; the
            caller stays where it is. The ranks keep the same environment contract, logs and
            failure reports; they see the caller's own folders on their import path but not
            its installed packages. The function travels by reference when it is importable
            there (define it in a module), so that environment must have what it imports.
    """
    options = LaunchOptions(
        gpus=gpus,
        gpu_type=gpu_type,
        nnodes=nnodes,
        timeout=timeout,
        init_process_group=init_process_group,
        max_restarts=max_restarts,
        env=dict(env or {}),
        collective_timeout=collective_timeout,
        hang_timeout=hang_timeout,
        stop_grace=stop_grace,
        stop_file=stop_file,
        remote=remote,
        ray_address=ray_address,
        python=python,
    )
    # Counts that can never work fail at decoration time; GPU presence is checked at launch.
    resolve_resources(options.gpus, "cpu", options.nnodes)

    def wrap(fn: Callable[P, R]) -> DistributedFunction[P, R]:
        return DistributedFunction(fn, options)

    return wrap
