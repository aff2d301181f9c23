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
"""

import contextlib
import functools
import inspect
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Generic, ParamSpec, TypeVar

import cloudpickle
import psutil

from trainflow.errors import LaunchError, LaunchTimeoutError, PayloadError, RankError
from trainflow.paths import trainflow_home
from trainflow.resources import LaunchPlan, resolve_resources
from trainflow.run_dir import RunDir

P = ParamSpec("P")
R = TypeVar("R")

LineSink = Callable[[int, str], None]

RDZV_ENDPOINT_ENV = "TRAINFLOW_RDZV_ENDPOINT"
RUN_ID_ENV = "TRAINFLOW_RUN_ID"
START_METHOD_ENV = "TRAINFLOW_START_METHOD"
# After the first rank fails, torch elastic stops the others; give it this long before we do.
FAILURE_GRACE_S = 5.0
# SIGTERM-to-SIGKILL grace for workers, for the agent and for our final sweep.
SHUTDOWN_GRACE_S = 3.0


@dataclass(frozen=True)
class LaunchOptions:
    """How to launch: the decorator's arguments, validated."""

    gpus: int
    gpu_type: str | None = None
    nnodes: int = 1
    timeout: float | None = None
    init_process_group: bool = False
    max_restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
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


def _print_line(rank: int, line: str) -> None:
    print(f"[rank {rank}] {line}", flush=True)


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


def stop_process_group(pgid: int, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """SIGTERM every live process of the group, then SIGKILL what is left after `grace_s`."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_members(pgid):
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


class _LogTail:
    """Follows the per-rank log files and hands out complete lines."""

    def __init__(self, rd: RunDir, sink: LineSink):
        self.rd = rd
        self.sink = sink
        self.offsets: dict[int, int] = {}
        self.partial: dict[int, bytes] = {}

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
            elif rest:
                self.partial[rank] = rest
            for line in lines:
                self.sink(rank, line.decode("utf-8", errors="replace").rstrip("\r"))


def _tail(path: Path, num_lines: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(lines[-num_lines:])


class _Launch:
    """One supervised launch: plan, start, watch, stop, collect."""

    def __init__(self, fn: Callable[..., Any], options: LaunchOptions, sink: LineSink):
        self.fn = fn
        self.options = options
        self.sink = sink
        self.name = getattr(fn, "__name__", "fn")

    def _rendezvous(self) -> tuple[str, str]:
        if self.options.nnodes == 1:
            return "127.0.0.1:0", uuid.uuid4().hex
        endpoint, run_id = os.environ.get(RDZV_ENDPOINT_ENV), os.environ.get(RUN_ID_ENV)
        if not endpoint or not run_id:
            raise LaunchError(
                f"nnodes={self.options.nnodes} needs a rendezvous shared by all nodes: set "
                f"{RDZV_ENDPOINT_ENV}=host:port (reachable from every node) and {RUN_ID_ENV} "
                "to the same value on each node, then call .distributed() on every node"
            )
        return endpoint, run_id

    def _env(self, res: LaunchPlan) -> dict[str, str]:
        env = {
            "PYTHONUNBUFFERED": "1",
            "TRAINFLOW_DEVICE": res.device,
            "PYTHONPATH": os.pathsep.join(_caller_sys_path()),
        }
        if res.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"  # what torchrun does, to avoid oversubscription
        if res.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        env.update(self.options.env)
        return env

    @staticmethod
    def _start_method(res: LaunchPlan) -> str:
        """fork on CPU: ranks start ~2x sooner, as torch is already imported in the agent.

        spawn on GPUs, the method torch recommends with CUDA, where start-up time is small next
        to training. TRAINFLOW_START_METHOD overrides either.
        """
        method = os.environ.get(START_METHOD_ENV) or ("fork" if res.device == "cpu" else "spawn")
        if method not in ("fork", "spawn", "forkserver"):
            raise LaunchError(f"{START_METHOD_ENV}={method!r}: use fork, spawn or forkserver")
        return method

    def run(self, args: tuple, kwargs: dict) -> LaunchResult:
        opts = self.options
        res = resolve_resources(opts.gpus, opts.gpu_type, opts.nnodes)
        payload = _bind_payload(self.fn, args, kwargs)
        endpoint, run_id = self._rendezvous()
        env = self._env(res)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        rd = RunDir(trainflow_home() / "runs" / f"{stamp}-{self.name}-{uuid.uuid4().hex[:8]}")
        rd.create(
            {
                "function": getattr(self.fn, "__qualname__", self.name),
                "run_id": run_id,
                "rdzv_endpoint": endpoint,
                "rdzv_timeout_s": int(opts.timeout) if opts.timeout else 900,
                "nnodes": res.nnodes,
                "nproc_per_node": res.nproc_per_node,
                "device": res.device,
                "max_restarts": opts.max_restarts,
                "shutdown_timeout_s": SHUTDOWN_GRACE_S,
                "init_process_group": opts.init_process_group,
                "start_method": self._start_method(res),
                "sys_path": _caller_sys_path(),
                # Names only: values (tokens, keys) travel in the agent's environment and are
                # never written to disk.
                "env_names": sorted(env),
                "caller_pid": os.getpid(),
            },
            payload,
        )
        with open(rd.agent_log, "wb") as agent_log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trainflow._agent", str(rd.path)],
                stdin=subprocess.DEVNULL,
                stdout=agent_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **env},
            )
        try:
            timed_out = self._supervise(proc, rd)
        finally:
            stop_process_group(proc.pid)
            proc.wait()
        try:
            return self._collect(proc.returncode, rd, res, timed_out)
        finally:
            rd.discard_payloads()

    def _supervise(self, proc: subprocess.Popen, rd: RunDir) -> bool:
        """Stream logs until the agent exits; stop it on timeout or a lingering failure."""
        self._tail = _LogTail(rd, self.sink)
        deadline = time.monotonic() + self.options.timeout if self.options.timeout else None
        failed_at: float | None = None
        try:
            while proc.poll() is None:
                self._tail.poll()
                now = time.monotonic()
                # With restarts allowed, a failed attempt is the elastic agent's call to make.
                if failed_at is None and self.options.max_restarts == 0 and rd.error_files():
                    failed_at = now
                if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
                    return False
                if deadline is not None and now > deadline:
                    return True
                time.sleep(0.05)
            return False
        finally:
            self._tail.poll()

    def _collect(
        self, returncode: int, rd: RunDir, res: LaunchPlan, timed_out: bool
    ) -> LaunchResult:
        self._tail.poll(final=True)
        log_dir = str(rd.logs)
        errors = {r: pickle.loads(p.read_bytes()) for r, p in rd.error_files().items()}
        results = rd.result_files()
        expected = list(range(res.nproc_per_node)) if res.nnodes == 1 else sorted(rd.log_files())
        missing = [r for r in expected if r not in results]
        if timed_out:
            running = [r for r in expected if r not in results] or expected
            raise LaunchTimeoutError(
                f"{self.name}.distributed() timed out after {self.options.timeout:g}s; "
                f"rank(s) {', '.join(map(str, running))} still running were stopped. "
                f"Rank logs: {log_dir}",
                running_ranks=running,
                log_dir=log_dir,
            )
        if errors and (returncode != 0 or missing):
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
        return LaunchResult(values, rd.path, rd.log_files(), res)

    def _rank_error(self, errors: dict[int, dict], log_dir: str) -> RankError:
        first = min(errors, key=lambda r: (errors[r]["time"], r))
        rec = errors[first]
        others = sorted(r for r in errors if r != first)
        message = (
            f"rank {first} failed while {rec['where']} with {rec['type_name']}: {rec['message']}"
            + (f"\n(failed after it: rank {', '.join(map(str, others))})" if others else "")
            + f"\n\nTraceback from rank {first}:\n{rec['traceback'].rstrip()}"
            + f"\n\nRank logs: {log_dir}"
        )
        error = RankError(
            message,
            rank=first,
            exc_type=rec["type"],
            remote_traceback=rec["traceback"],
            failed_ranks=sorted(errors),
            log_dir=log_dir,
        )
        if rec["exception"] is not None:
            # The exception class may not import in the caller; the text above still names it.
            with contextlib.suppress(Exception):
                error.__cause__ = cloudpickle.loads(rec["exception"])
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
        LaunchError: the agent or a rank died without a Python error (signal, OOM, ...).
    """
    return _Launch(fn, options, on_line or _print_line).run(tuple(args), dict(kwargs or {}))


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
        if "prefect" in sys.modules:
            from trainflow import prefect_adapter

            if prefect_adapter.in_prefect_run():
                return prefect_adapter.launch_in_prefect(self.fn, args, kwargs, self.options).values
        return launch(self.fn, args, kwargs, options=self.options).values

    def __reduce__(self) -> Any:
        # Ship the plain function: ranks call it directly.
        return (_rebuild, (self.fn, self.options))


def _rebuild(fn: Callable[..., Any], options: LaunchOptions) -> DistributedFunction:
    return DistributedFunction(fn, options)


def distributed(
    gpus: int,
    gpu_type: str | None = None,
    *,
    nnodes: int = 1,
    timeout: float | None = None,
    init_process_group: bool = False,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
) -> Callable[[Callable[P, R]], DistributedFunction[P, R]]:
    """Decorate a function so `fn.distributed(...)` runs it on `gpus` ranks.

    Args:
        gpus: Total number of ranks across all nodes (one GPU each when on GPUs).
        gpu_type: None uses what the machine has (GPUs, else CPU ranks with gloo); "cpu" forces
            CPU ranks; a GPU name ("H100", "A10") must match the GPUs present, unless
            TRAINFLOW_CPU_FALLBACK=1, which runs CPU ranks with a warning.
        nnodes: Number of nodes. With more than one, call `.distributed()` on every node with
            TRAINFLOW_RDZV_ENDPOINT and TRAINFLOW_RUN_ID set alike; each node returns the values
            of its own ranks.
        timeout: Seconds for the whole call; past it every rank is stopped and
            `LaunchTimeoutError` names the ranks still running.
        init_process_group: Initialise the default process group (gloo on CPU, nccl on CUDA
            with the device bound to LOCAL_RANK) before the function and destroy it after.
        max_restarts: Times torch elastic restarts all ranks after a failure.
        env: Extra environment variables for every rank.
    """
    options = LaunchOptions(
        gpus=gpus,
        gpu_type=gpu_type,
        nnodes=nnodes,
        timeout=timeout,
        init_process_group=init_process_group,
        max_restarts=max_restarts,
        env=dict(env or {}),
    )
    # Counts that can never work fail at decoration time; GPU presence is checked at launch.
    resolve_resources(options.gpus, "cpu", options.nnodes)

    def wrap(fn: Callable[P, R]) -> DistributedFunction[P, R]:
        return DistributedFunction(fn, options)

    return wrap
