"""How the GPU acceptance run (`benchmarks.gpu_acceptance`) runs its parts: each in a process
under a timeout of its own, what they wait for prepared in the background, within one budget.

A part's process is `python -m benchmarks.gpu_acceptance_parts PART...` under
`trainflow.launch.guard`, in a session of its own: a part that overruns its timeout is stopped
with everything it started (SIGTERM to its group, SIGKILL after a grace), and so is every part
if this process is stopped or dies. It imports the standard library only (Prefect's server
helper once a pipeline's part waits for the server).
"""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUILD_WAIT_S = 300.0  # DeepSpeed's fused Adam, compiled with nvcc on first use
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class Part:
    """One check of the acceptance run: what it runs, what it needs, how long it may take."""

    name: str
    checks: str
    needs: tuple[str, ...]  # import names; a missing one skips the part
    timeout_s: float
    dry_timeout_s: float
    shown: tuple[str, ...]  # figures in the table (the JSON has them all)
    goal: str = ""
    group: str | None = None  # --dry: the parts of a group share one process
    waits_for: tuple[str, ...] = ()  # fused_adam, mlflow, prefect: prepared beside the parts
    # Made from the other parts' outcomes (no process of its own): (outcomes, dry) -> outcome
    derive: Callable[[dict[str, dict[str, Any]], bool], dict[str, Any]] | None = None


def installed(name: str) -> bool:
    with contextlib.suppress(ImportError, ValueError):
        return importlib.util.find_spec(name) is not None
    return False


@contextlib.contextmanager
def guarded(command: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """`command` in a session of its own under `trainflow.launch.guard`, which stops it and
    everything it starts if this process dies; stopped (group SIGTERM, then SIGKILL) at exit."""
    with open(log, "a") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainflow.launch.guard", str(os.getpid()), "--", *command],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Acceptance:
    """Runs the parts, what they wait for in the background, then the parts made from their
    outcomes (`Part.derive`); keeps each part's outcome."""

    def __init__(self, parts: list[Part], out: Path, *, dry: bool, jobs: int, budget_s: float):
        self.parts, self.dry, self.jobs, self.budget_s = parts, dry, jobs, budget_s
        self.logs, self.work = out / "logs", out / "work"
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.outcomes: dict[str, dict[str, Any]] = {}
        self.prepared: dict[str, dict[str, Any]] = {}  # what was waited for, and when it was there
        self._lock = threading.Lock()  # outcomes and the lines printed
        self._stopping = threading.Event()  # Ctrl-C or SIGTERM: stop every part's process
        # name -> (wait for it: why it is not there or None, a lock: one thread waits)
        self._pending: dict[str, tuple[Callable[[], str | None], threading.Lock]] = {}

    def record(self, name: str, outcome: dict[str, Any]) -> None:
        with self._lock:
            self.outcomes[name] = outcome
            reason = f": {outcome['reason']}" if outcome.get("reason") else ""
            status, wall = outcome["status"], outcome["wall_s"]
            print(f"== {name}: {status} in {wall:.1f} s{reason}", flush=True)

    def run(self, stack: contextlib.ExitStack) -> None:
        runnable = []
        for p in self.parts:
            for old in (self.logs / f"{p.name}.log", self.logs / f"{p.name}.json"):
                old.unlink(missing_ok=True)  # an earlier run's, into the same folder
            missing = [n for n in p.needs if not installed(n)]
            if missing:
                reason = f"needs {', '.join(missing)}, not installed here"
                self.record(p.name, {"status": "skipped", "reason": reason, "wall_s": 0.0})
            elif p.derive is None:
                runnable.append(p)
        self._prepare({w for p in runnable for w in p.waits_for}, stack)
        units: dict[str, list[Part]] = {}
        for p in runnable:  # on the GPU one part a process: each measures on a clean device
            units.setdefault(p.group if self.dry and p.group else p.name, []).append(p)
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            running = [pool.submit(self._run_unit, unit) for unit in units.values()]
            try:
                for done in running:
                    done.result()
            except BaseException:
                self._stopping.set()  # the pool's exit waits for its threads: end them now
                raise
        for p in self.parts:
            if p.derive is not None and p.name not in self.outcomes:
                self.record(p.name, p.derive(self.outcomes, self.dry))

    def _prepare(self, wanted: set[str], stack: contextlib.ExitStack) -> None:
        """Start what parts wait for, while the first parts run: DeepSpeed's fused Adam, built
        (nvcc, a minute or more) on the CPU while the GPU measures MFU; the pipelines' MLflow
        store, created (its schema: seconds) before the first pipeline opens it; and one Prefect
        server for every pipeline (its start is seconds of CPU)."""
        if "fused_adam" in wanted and not self.dry:
            # As the ranks do: first make TORCH_CUDA_ARCH_LIST one DeepSpeed's builder reads
            # (CUDA images list 9.0a).
            build = (
                "from trainflow.strategies.deepspeed import prepare_compiled_ops\n"
                "prepare_compiled_ops('cuda')\n"
                "from deepspeed.ops.op_builder import FusedAdamBuilder\n"
                "FusedAdamBuilder().load()\n"
            )
            self._background("fused_adam", build, BUILD_WAIT_S, stack)
        if "mlflow" in wanted:
            store = "from trainflow.tracking import store_client\nstore_client()\n"
            self._background("mlflow", store, 120.0, stack)
        if "prefect" in wanted:
            from flows.local_server import starting_prefect_server

            ready = stack.enter_context(starting_prefect_server())

            def serving() -> str | None:
                try:
                    self.prepared["prefect"]["url"] = ready()
                except Exception as exc:  # the flows cannot run without it: they fail, naming it
                    return f"the Prefect server did not start: {exc}"
                return None

            self._pending["prefect"] = (serving, threading.Lock())
            self.prepared["prefect"] = {}

    def _background(self, name: str, code: str, wait_s: float, stack: contextlib.ExitStack) -> None:
        log = self.logs / f"{name}.log"
        log.unlink(missing_ok=True)
        proc = stack.enter_context(guarded([sys.executable, "-c", code], log))

        def done() -> str | None:
            # A failed preparation is recorded; the parts run anyway and fail on it, naming it.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(min(wait_s, self.deadline - time.monotonic()), 0))
            stop(proc)
            code = proc.returncode
            self.prepared[name]["status"] = "ok" if code == 0 else f"failed ({code}, see {log})"
            return None

        self._pending[name] = (done, threading.Lock())
        self.prepared[name] = {}

    def _wait_for(self, names: set[str]) -> str | None:
        """Wait until the preparations `names` are there; why one is not, or None."""
        for name in sorted(names & self._pending.keys()):
            wait, lock = self._pending[name]
            with lock:
                record = self.prepared[name]
                if "ready_after_s" not in record:
                    record["problem"] = wait()
                    record["ready_after_s"] = round(time.monotonic() - self.started, 1)
            if record["problem"] is not None:
                return str(record["problem"])
        return None

    def _run_unit(self, parts: list[Part]) -> None:
        pending = list(parts)
        while pending and not self._stopping.is_set():
            pending = self._run_process(pending)

    def _run_process(self, pending: list[Part]) -> list[Part]:
        """Run `pending` in one process, in order, each under its timeout; what is left to run
        in a new process when one of them timed out or took the process down."""
        first = pending[0]
        problem = self._wait_for({w for p in pending for w in p.waits_for})
        if problem is None and self.deadline - time.monotonic() < 1:
            problem = f"not started: the run's {self.budget_s:.0f} s were spent"
        if problem is not None:
            self.record(first.name, {"status": "failed", "reason": problem, "wall_s": 0.0})
            return pending[1:]
        command = [sys.executable, "-m", "benchmarks.gpu_acceptance_parts"]
        command += [p.name for p in pending]
        command += ["--out", str(self.logs), "--work", str(self.work)]
        command += ["--dry"] if self.dry else []
        with guarded(command, self.logs / f"{first.name}.log") as proc:
            for at, p in enumerate(pending):
                timeout = p.dry_timeout_s if self.dry else p.timeout_s
                outcome = self._watch(proc, p, min(timeout, self.deadline - time.monotonic()))
                self.record(p.name, outcome)
                if proc.poll() is not None and at + 1 < len(pending):
                    return pending[at + 1 :]  # its process is gone: the rest in a new one
        return []

    def _watch(self, proc: subprocess.Popen, p: Part, limit: float) -> dict[str, Any]:
        """The outcome of part `p`, running in `proc`: its own, or failed when its process
        ended without one or it overran `limit` (its process is stopped then)."""
        result = self.logs / f"{p.name}.json"
        begun = time.monotonic()
        while not result.exists():
            elapsed = time.monotonic() - begun
            if proc.poll() is not None:
                reason = f"its process exited {proc.returncode} without an outcome (see the log)"
                return {"status": "failed", "reason": reason, "wall_s": elapsed}
            if elapsed > limit or self._stopping.is_set():
                stop(proc)
                reason = "stopped" if self._stopping.is_set() else f"timed out after {limit:.0f} s"
                return {"status": "failed", "reason": reason, "wall_s": elapsed}
            time.sleep(0.2)
        return dict(json.loads(result.read_text()))
