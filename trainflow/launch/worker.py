"""What each rank runs: load the shipped function, run it, write its result or its error.

Torch elastic spawns this module's `main` on every rank; it must stay importable without the
caller's code, so everything user-specific arrives through the run directory.
"""

import ctypes
import faulthandler
import json
import os
import signal
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any

import cloudpickle
import torch

from trainflow import runtime
from trainflow.compat import cpu_fallback, stdlib
from trainflow.errors import PayloadError
from trainflow.launch.run_dir import RunDir
from trainflow.launch.ship import restore_source
from trainflow.launch.spec import AGENT_PID_ENV

# How deep the parts of an unpicklable return value are searched.
_RETURN_DEPTH = 5


def _redirect_output(path: Path) -> None:
    """Send this process's stdout and stderr (Python and C level) to one line-buffered file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)


def _error_record(exc: BaseException, rank: int, where: str) -> dict[str, Any]:
    try:
        shipped: bytes | None = cloudpickle.dumps(exc)
    except Exception:
        shipped = None
    return {
        "rank": rank,
        "where": where,
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "type_name": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "time": time.time(),
        "exception": shipped,
    }


def _read_sources(rd: RunDir) -> dict[str, list[str]]:
    try:
        return json.loads(rd.sources.read_text())
    except (OSError, ValueError):
        return {}


def _parts(value: object, path: str) -> list[tuple[str, object]]:
    if isinstance(value, dict):
        return [(f"{path}[{k!r}]", v) for k, v in value.items()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict) and not isinstance(value, (type, types.ModuleType)):
        return [(f"{path}.{k}", v) for k, v in attributes.items()]
    return []


def _unpicklable(value: object, path: str, depth: int = 0) -> tuple[str, object, Exception]:
    """The innermost part of `value` (as an expression) that does not pickle, and why."""
    try:
        cloudpickle.dumps(value)
    except Exception as exc:
        if depth < _RETURN_DEPTH:
            for part_path, part in _parts(value, path):
                try:
                    cloudpickle.dumps(part)
                except Exception:
                    return _unpicklable(part, part_path, depth + 1)
        return path, value, exc
    raise ValueError(f"{path} pickles")  # only called for a value that did not


def _tensors(value: object, path: str, found: dict[str, object], depth: int = 0) -> None:
    """Every tensor in `value` and every module's state dict, by where they are."""
    if isinstance(value, torch.Tensor):
        found[path] = value.detach().cpu()
    elif isinstance(value, torch.nn.Module):
        found[f"{path}.state_dict()"] = {k: v.detach().cpu() for k, v in value.state_dict().items()}
    elif depth < _RETURN_DEPTH:
        for part_path, part in _parts(value, path):
            _tensors(part, part_path, found, depth + 1)


def _send_result(rd: RunDir, rank: int, value: object) -> None:
    """Pickle the return value now, before teardown; if it cannot travel, keep its tensors."""
    try:
        data = cloudpickle.dumps(value)
    except Exception:
        path, part, exc = _unpicklable(value, "result")
        kept: dict[str, object] = {}
        _tensors(value, "result", kept)
        message = (
            f"the return value of rank {rank} cannot be sent back: {path} "
            f"({type(part).__qualname__}) cannot be pickled ({exc})."
        )
        if kept:
            target = rd.path / "kept" / f"rank_{rank}.pt"
            target.parent.mkdir(parents=True, exist_ok=True)
            torch.save(kept, target)
            message += f" Its tensors were kept in {target} (torch.load): " + ", ".join(kept)
        raise PayloadError(
            message + ". Return plain values, tensors or state dicts instead."
        ) from None
    rd.write_result(rank, data)


def _on_sigterm(signum: int, frame: object) -> None:
    runtime.request_stop()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_agent() -> None:
    """A rank never outlives its agent (Linux): the kernel SIGKILLs it when the agent dies.

    The agent stops its ranks itself on every path it lives through; this covers the one it
    does not: the agent killed outright (SIGKILL, the OOM killer, a cluster manager stopping
    the process that hosts it).
    """
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    agent = os.environ.get(AGENT_PID_ENV, "")
    if agent.isdigit() and os.getppid() != int(agent):
        os._exit(1)  # the agent died before the request was in place


def _reset_process_state() -> None:
    """Undo what a forked rank inherits from the agent: signal handlers, thread count, temp dir.

    SIGTERM (a preemption, or the caller stopping the launch) only sets the flag
    `runtime.should_stop()` reads: the training loop ends its step, writes a final checkpoint
    and stops; whoever sent it sends SIGKILL after its grace period. SIGINT stays
    KeyboardInterrupt (ranks are in the agent's session, so a terminal's Ctrl-C never reaches
    them; the caller turns its own Ctrl-C into that SIGTERM).
    """
    for sig in (signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    tempfile.tempdir = None  # TMPDIR again: the launch's folder for its ranks, not the agent's
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def main(run_dir: str) -> None:
    """Entry point of every rank (called by torch elastic with the run directory)."""
    _die_with_agent()
    _reset_process_state()
    rd = RunDir(Path(run_dir))
    rank = runtime.get_global_rank()
    os.environ.setdefault("NODE_RANK", os.environ.get("GROUP_RANK", "0"))
    _redirect_output(rd.log_path(rank))
    # SIGUSR1 writes every thread's Python stack to the rank's log, from the signal handler
    # itself, so it works while the rank is stuck in C code (a collective, a sleep). The
    # launcher sends it to a hung rank before stopping it.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rd.write_rank_process(rank, os.getpid(), attempt)  # after the SIGUSR1 handler is in place
    if attempt:
        print(f"--- restart attempt {attempt} ---", flush=True)

    spec = rd.read_spec()
    forked = spec.start_method == "fork"
    if forked:
        # A forked rank ends in `os._exit`, which skips exit handlers: run the rank's own at
        # the end (streaming's unlinks its shared memory there; skipped, the resource tracker
        # warns of leaked objects), never the agent's, inherited through the fork.
        stdlib.clear_exit_handlers()
    os.environ[runtime.RUN_DIR_ENV] = str(rd.path)
    os.environ[runtime.COLLECTIVE_TIMEOUT_ENV] = str(spec.collective_timeout_s)
    # The rank's failure is recorded once, atomically, in the run folder (`write_error`). torch
    # elastic would also write it to this file, in place: a rank killed mid-write (its peer
    # died, the agent stops the survivors) left it empty, and the agent, failing to parse it,
    # crashed instead of restarting the ranks.
    os.environ.pop("TORCHELASTIC_ERROR_FILE", None)
    for entry in reversed(spec.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    cpu_fallback.install(rd.path, rank, spec.device, spec.collective_timeout_s)

    where = "loading the function and its arguments"
    created_group = False
    try:
        fn, args, kwargs = cloudpickle.loads(rd.payload.read_bytes())
        restore_source(fn, spec.code_files, _read_sources(rd))
        if spec.init_process_group:
            where = "initialising the process group"
            runtime.init_process_group()
            created_group = True
        where = "running the function"
        value = fn(*args, **kwargs)
        where = "sending the return value back"
        _send_result(rd, rank, value)
        rd.clear_error(rank)  # an earlier attempt's failure, now superseded
    except BaseException as exc:
        rd.write_error(rank, cloudpickle.dumps(_error_record(exc, rank, where)))
        raise
    finally:
        if created_group:
            runtime.destroy_process_group()
        if forked:
            stdlib.run_exit_handlers()
        sys.stdout.flush()
        sys.stderr.flush()
