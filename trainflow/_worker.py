"""What each rank runs: load the shipped function, run it, write its result or its error.

Torch elastic spawns this module's `main` on every rank; it must stay importable without the
caller's code, so everything user-specific arrives through the run directory.
"""

import faulthandler
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import cloudpickle
import torch

from trainflow import runtime
from trainflow.run_dir import RunDir


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


def _on_sigterm(signum: int, frame: object) -> None:
    runtime.request_stop()


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
    tempfile.tempdir = None  # the system's again, not the agent's folder in the run directory
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def main(run_dir: str) -> None:
    """Entry point of every rank (called by torch elastic with the run directory)."""
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
    os.environ[runtime.RUN_DIR_ENV] = str(rd.path)
    os.environ[runtime.COLLECTIVE_TIMEOUT_ENV] = str(spec["collective_timeout_s"])
    for entry in reversed(spec["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)

    where = "loading the function and its arguments"
    created_group = False
    try:
        fn, args, kwargs = cloudpickle.loads(rd.payload.read_bytes())
        if spec["init_process_group"]:
            where = "initialising the process group"
            runtime.init_process_group()
            created_group = True
        where = "running the function"
        value = fn(*args, **kwargs)
        where = "sending the return value back"
        rd.write_result(rank, cloudpickle.dumps(value))
        rd.clear_error(rank)  # an earlier attempt's failure, now superseded
    except BaseException as exc:
        rd.write_error(rank, cloudpickle.dumps(_error_record(exc, rank, where)))
        raise
    finally:
        if created_group:
            runtime.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
