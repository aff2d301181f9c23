"""The helper process that hosts torch's elastic agent for one launch.

Started by the caller in its own session (`python -m trainflow.launch.agent RUN_DIR`), so that the
agent, its workers and anything they start form one process group the caller can stop at once,
and the caller's process keeps no elastic signal handlers or multiprocessing helpers behind.
"""

# ruff: noqa: E402  (the collector is turned off before the imports below)
import gc

if __name__ == "__main__":
    # Before its ranks start, the agent mostly imports: torch, then the workload's libraries
    # (`standby`). With the cyclic collector off meanwhile they take about a fifth less CPU
    # (some ten full collections of a growing heap, which free next to nothing), on the way to
    # the first step. It is turned back on before the ranks fork (`_collect_from_here`).
    gc.disable()

import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

import psutil
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainflow.compat import stdlib
from trainflow.compat import torch as compat_torch
from trainflow.launch import temp, worker
from trainflow.launch.listen import elastic_store_server, node_address
from trainflow.launch.run_dir import RunDir
from trainflow.launch.spec import AGENT_PID_ENV, LaunchSpec, LaunchSpecError

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _adopt_orphans() -> None:
    """Become the subreaper of everything the ranks start (Linux).

    A process a rank starts in its own session (a compiler a build tool spawns, a
    `Popen(..., start_new_session=True)`) is out of reach of a group kill, and when its parent
    exits it would be re-parented to init and outlive the launch. As subreaper, this agent
    adopts it instead, and `_stop_descendants` finds it.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _stop_descendants(grace_s: float = 3.0) -> None:
    """Stop and reap every process left under this agent: ranks' children and adopted orphans.

    SIGTERM first, and `grace_s` for what is ending anyway (a multiprocessing resource
    tracker still unlinking the shared memory its rank left), then SIGKILL; with no grace,
    SIGKILL at once (a SIGTERM would ask the ranks for a final checkpoint).
    """
    left = psutil.Process().children(recursive=True)
    alive = left
    if grace_s > 0:
        for proc in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        _, alive = psutil.wait_procs(left, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


# The launch this agent runs, once it knows it (a standby agent learns it when claimed).
_run_dir: RunDir | None = None
# The standby log of an agent started ahead, until a launch claims it (`standby`).
_early_log: Path | None = None
# The ranks' temp folder, once made (`trainflow.launch.temp`).
_ranks_temp: Path | None = None


def _exit_with_parent(parent_pid: int) -> None:
    """If the caller dies without stopping us (SIGKILL, OOM), take everything down."""
    while True:
        if os.getppid() != parent_pid:
            # What the caller would have removed, and cannot any more.
            if _run_dir is not None:
                _run_dir.payload.unlink(missing_ok=True)
            if _early_log is not None:
                _early_log.unlink(missing_ok=True)  # a standby agent no launch claimed
            _stop_descendants(grace_s=0)  # as if the machine were lost: no final checkpoint
            temp.remove_ranks_temp(_ranks_temp)
            os.killpg(os.getpgrp(), signal.SIGKILL)
        time.sleep(0.5)


def _preload(name: str) -> tuple[list[str], list[str]]:
    """Import module `name`, then the modules it lists in `RANK_IMPORTS` that are installed:
    what its ranks import only once they run (a workload module stays light for the flow's
    process, which imports it too but never trains). Returns the names imported and, for
    each that failed, `module: error`; one failure does not stop the rest."""
    done: list[str] = []
    failed: list[str] = []
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        return done, [f"{name}: {exc!r}"]
    done.append(name)
    for extra in getattr(module, "RANK_IMPORTS", ()):
        try:
            if importlib.util.find_spec(extra.partition(".")[0]) is None:
                continue  # not installed: its rank code never needs it here
            importlib.import_module(extra)
        except Exception as exc:
            failed.append(f"{extra} (RANK_IMPORTS of {name}): {exc!r}")
        else:
            done.append(extra)
    return done, failed


def _warm_up(preload: list[str]) -> None:
    """Run the `RANK_WARMUPS` (module:function) of the preloaded modules: what their ranks
    would build on first use, built once here for the ranks forked from this agent. A warm-up
    that fails is reported and skipped: the ranks build it themselves."""
    for name in preload:
        module = sys.modules.get(name)
        for ref in getattr(module, "RANK_WARMUPS", ()):
            started = time.monotonic()
            try:
                owner, _, function = ref.partition(":")
                getattr(importlib.import_module(owner), function)()
            except Exception as exc:
                print(f"standby agent: warm-up {ref} failed: {exc!r}", flush=True)
            else:
                took = time.monotonic() - started
                print(f"standby agent: ran {ref} in {took:.1f}s", flush=True)


def run_calls(calls: list[dict[str, Any]], outcomes: IO[str]) -> None:
    """Run the calls the caller asked for ahead (a check first), importing what they need here.

    Each call is `function` (module:function, called with `argument`, a JSON value). Its
    outcome is written to `outcomes` as one JSON line as soon as it is known: `value` (what it
    returned), `refused` (the message of the `ValueError` it raised: the config or data is
    wrong) or `failed` (any other error's traceback). After one that does not return a value,
    the rest are `skipped`: the caller does them if it still needs them.
    """
    skip = None
    for call in calls:
        if skip is not None:
            outcomes.write(json.dumps({"skipped": skip}) + "\n")
            outcomes.flush()
            continue
        started = time.monotonic()
        try:
            module, _, name = call["function"].partition(":")
            value = getattr(importlib.import_module(module), name)(call["argument"])
            outcome: dict[str, object] = {"value": value}
        except ValueError as exc:
            outcome = {"refused": str(exc)}
        except Exception:
            outcome = {"failed": traceback.format_exc()}
        outcomes.write(json.dumps(outcome) + "\n")
        outcomes.flush()
        took = time.monotonic() - started
        print(f"standby agent: ran {call['function']} in {took:.1f}s", flush=True)
        if "value" not in outcome:
            skip = f"{call['function']} did not return a value"


def _collect_from_here() -> None:
    """Put what is loaded so far out of the cyclic collector's sight, and turn the collector
    back on (it is off while the agent imports: see the top of this module).

    What was imported lives as long as the ranks forked from here: frozen, a full collection
    in a rank (freeing the training state before evaluation) takes milliseconds instead of
    most of a second, and pages shared with the ranks stay shared.
    """
    gc.freeze()
    gc.enable()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def standby(log: str, preload: list[str], outcomes_fd: int) -> int:
    """Run the caller's calls ahead (`run_calls`), import `preload`, then run the launch whose
    folder the caller writes to stdin.

    The calls come as the first line of stdin, their outcomes go back through `outcomes_fd`
    (see `trainflow.launch.standby`). An import that fails here is left for the ranks, which
    raise it with their rank's context. Output so far (warnings of the imports) goes to the
    launch's agent log once it is known.
    """
    global _early_log
    _early_log = Path(log)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    line = sys.stdin.readline()
    calls = json.loads(line) if line.strip() else []
    with os.fdopen(outcomes_fd, "w") as outcomes:
        if calls:
            # First, with only what the calls import: the caller waits for their answers, not
            # for the ranks' libraries, and goes on while they load. A caller that stops
            # meanwhile (Ctrl-C) sends SIGTERM first: a call writing files (a dataset's
            # staging folder) removes them on its way out.
            previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
            try:
                run_calls(calls, outcomes)
            finally:
                signal.signal(signal.SIGTERM, previous)
    started = time.monotonic()
    imported: list[str] = []
    for name in preload:
        done, failed = _preload(name)
        imported += done
        for failure in failed:
            print(f"standby agent: could not import {failure}", flush=True)
    took = time.monotonic() - started
    print(f"standby agent: imported {', '.join(imported) or 'nothing'} in {took:.1f}s", flush=True)
    _warm_up(preload)
    _collect_from_here()
    line = sys.stdin.readline().strip()
    if not line:  # not needed after all, or the caller is gone (its end of stdin closed)
        Path(log).unlink(missing_ok=True)
        return 0
    claim = json.loads(line)
    run_dir = claim["run_dir"]
    os.environ.clear()
    os.environ.update(claim["env"])  # the caller's as of the launch; the ranks inherit it
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    rd = RunDir(Path(run_dir))
    early = Path(log)
    with contextlib.suppress(OSError):
        rd.agent_log.write_bytes(early.read_bytes())
    fd = os.open(rd.agent_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    early.unlink(missing_ok=True)
    _early_log = None
    return main(run_dir, watching=True)


def _launch_config(spec: LaunchSpec, rd: RunDir) -> LaunchConfig:
    """torch elastic's configuration for the launch `spec` describes."""
    rdzv_configs: dict[str, object] = {"timeout": spec.rdzv_timeout_s}
    if spec.rdzv_is_host is not None:
        # The launcher that placed the nodes says which one hosts the rendezvous store; two
        # nodes on one host (or behind one address) would otherwise both try to.
        rdzv_configs["is_host"] = spec.rdzv_is_host
    # The stores this agent hosts listen on one address only: loopback for one node (its
    # rendezvous is 127.0.0.1:0), else this node's address toward the rendezvous host.
    address = node_address(spec.rdzv_endpoint.rpartition(":")[0])
    compat_torch.bind_elastic_stores(elastic_store_server(address))
    config = LaunchConfig(
        min_nodes=spec.min_nodes or spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc_per_node,
        run_id=spec.run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=spec.rdzv_endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=spec.max_restarts,
        monitor_interval=0.1,
        start_method=spec.start_method,
        logs_specs=DefaultLogsSpecs(log_dir=str(rd.elastic)),
    )
    if "local_addr" in LaunchConfig.__dataclass_fields__:
        # The ranks' MASTER_ADDR, and where the store they share listens.
        setattr(config, "local_addr", address)  # noqa: B010
    # torch before 2.8 (a framework's own environment) has no `shutdown_timeout`: its agent
    # then keeps its fixed 30 s grace. Seconds may be fractional, as torch's wait takes them.
    if "shutdown_timeout" in LaunchConfig.__dataclass_fields__:
        setattr(config, "shutdown_timeout", spec.shutdown_timeout_s)  # noqa: B010
    return config


def _use_ranks_temp(rd: RunDir) -> None:
    """Give the ranks (and everything they start) a temp folder of their own for this launch,
    removed when they have ended: what they leave there, in any way they end, goes with it."""
    global _ranks_temp
    tempfile.tempdir = None  # the temp folder the caller's environment names
    system = tempfile.gettempdir()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", temp.inductor_cache_default(system))
    _ranks_temp = temp.make_ranks_temp(system, rd.ranks_temp)
    os.environ["TMPDIR"] = str(_ranks_temp)


def main(run_dir: str, watching: bool = False) -> int:
    global _run_dir
    rd = _run_dir = RunDir(Path(run_dir))
    try:
        spec = rd.read_spec()
    except LaunchSpecError as exc:  # a caller on another trainflow release: say so, no rank
        rd.agent_error.write_text(f"{exc}\n")
        return 2
    if not gc.isenabled():  # an agent started for this launch, not one kept in standby
        _collect_from_here()
    _adopt_orphans()
    if not watching:
        threading.Thread(target=_exit_with_parent, args=(spec.caller_pid,), daemon=True).start()
    compat_torch.stop_workers_with_sigkill()
    compat_torch.name_rendezvous_events_cheaply()
    _use_ranks_temp(rd)
    # torch's process starter gives each rank a `pytorch-errorfile-*.pickle` in the temp folder
    # for its traceback and never removes it: keep those with this launch's logs. Ranks use
    # their own (`worker._reset_process_state`).
    tempfile.tempdir = str(rd.elastic_tmp)
    rd.elastic_tmp.mkdir(parents=True, exist_ok=True)

    config = _launch_config(spec, rd)
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the ranks' parent (see `worker`)
    try:
        elastic_launch(config, worker.main)(str(rd.path))
    except ChildFailedError as exc:
        rd.agent_error.write_text(exc.format_msg())
        return 1
    except SignalException as exc:
        # Stopped from outside (the caller's Ctrl-C, a node shutdown): the agent has already
        # given the workers `shutdown_timeout` to finish; exit as the signal would.
        return 128 + int(exc.sigval)
    finally:
        _stop_descendants()  # whatever the ranks started, in any session, ends with them
        temp.remove_ranks_temp(_ranks_temp)  # and what they left in their temp folder
        rd.payload.unlink(missing_ok=True)  # the function and its arguments: no longer needed
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--standby":
        # --standby LOG --outcomes FD MODULE...
        stdlib.exit_now(standby(sys.argv[2], sys.argv[5:], outcomes_fd=int(sys.argv[4])))
    # Once the launch is over the exit handlers run; the interpreter's teardown of the
    # modules the agent imported for its ranks (a second and more with transformers loaded,
    # which the caller would wait for) does not.
    stdlib.exit_now(main(sys.argv[1]))
