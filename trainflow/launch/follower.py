"""A follower node: runs its share of each launch its leader publishes on the launch board,
nothing else (see `trainflow.launch.board` for the protocol).

    python -m trainflow.launch.follower --board HOST:PORT [--node K] [--timeout S]
"""

import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import cloudpickle
import psutil

from trainflow.errors import (
    LaunchConfigError,
    LaunchError,
    StopRequested,
    first_line,
)
from trainflow.launch.board import (
    BOARD_ENV,
    CONNECT_RETRY_S,
    DEFAULT_FOLLOW_TIMEOUT_S,
    FOLLOW_TIMEOUT_ENV,
    NODE_INDEX_ENV,
    POLL_S,
    STOP_AFTER_FAILURE_S,
    STORE_TIMEOUT_S,
    BoardGone,
    BoardNotUp,
    Store,
    board_address,
    import_tcp_store,
    node_index,
)
from trainflow.launch.local import LocalLaunch
from trainflow.launch.plan import node_range
from trainflow.launch.processes import kill_process_group
from trainflow.launch.run_dir import request_stop, stop_path
from trainflow.launch.ship import Shipment
from trainflow.launch.spec import (
    SHUTDOWN_GRACE_S,
    LaunchOptions,
    rank_label,
)

logger = logging.getLogger(__name__)


class _Run:
    """One launch on this follower: this node's share, run in a thread of its own."""

    def __init__(self, store: Store, number: int, record: dict, node: int, folder: Path):
        self.store = store
        self.number = number
        self.node = node
        self.shipment: Shipment = record["shipment"]
        self.endpoint: str = record["endpoint"]
        self.run_id: str = record["run_id"]
        self.stop_file = folder / f"stop-{number}"
        # The leader's stop file is on the leader's machine: this share stops through its own.
        self.options: LaunchOptions = dataclasses.replace(
            record["options"], stop_file=str(self.stop_file)
        )
        self.leader_failed_at: float | None = None
        self.stop_reason: str | None = None
        self.thread = threading.Thread(target=self._run, name=f"launch-{number}", daemon=True)

    def _print(self, rank: int, line: str) -> None:
        print(f"{rank_label(rank, self.options)} {line}", flush=True)

    def _run(self) -> None:
        name = self.shipment.name
        try:
            launch = LocalLaunch(self.options, self._print, (self.endpoint, self.run_id, False))
            result = launch.run(self.shipment)
            outcome: tuple = ("ok", result.ranks)
            said = f"ranks {result.ranks} done"
        except BaseException as exc:  # reported to the leader, which decides
            if isinstance(exc, StopRequested) and self.stop_reason:
                # Not a stop anyone asked of the run (StopRequested is never retried).
                exc = LaunchError(
                    f"node {self.node} stopped its share of launch {self.number}: "
                    f"{self.stop_reason}. Rank logs: {exc.log_dir}",
                    log_dir=exc.log_dir,
                )
            text = f"{type(exc).__name__}: {first_line(str(exc))}"
            try:
                blob = cloudpickle.dumps(exc)
            except Exception:
                blob = cloudpickle.dumps(LaunchError(str(exc)))
            outcome = ("error", blob, text)
            said = f"failed: {text}"
        _say(f"launch {self.number} ({name}.distributed()) on node {self.node}: {said}")
        with contextlib.suppress(BoardGone):
            self.store.set(f"result/{self.number}/{self.node}", cloudpickle.dumps(outcome))

    def start(self) -> None:
        _say(
            f"launch {self.number}: {self.shipment.name}.distributed() on node {self.node} "
            f"(rendezvous {self.endpoint}, run id {self.run_id})"
        )
        self.thread.start()

    def running(self) -> bool:
        return self.thread.is_alive()

    def watch_leader(self) -> None:
        """Stop this share a little after the leader's share of the launch failed."""
        if self.leader_failed_at is None:
            key = f"end/{self.number}"
            if self.store.has(key) and self.store.get(key) == b"failed":
                self.leader_failed_at = time.monotonic()
        elif time.monotonic() - self.leader_failed_at > STOP_AFTER_FAILURE_S:
            self.stop("the leader's share of it had failed")

    def stop(self, reason: str) -> None:
        """Ask this share to stop as a preemption would (ranks get `stop_grace`)."""
        self.stop_reason = self.stop_reason or reason
        request_stop(self.stop_file)

    def join(self, seconds: float) -> None:
        self.thread.join(seconds)


def _say(text: str) -> None:
    print(f"[trainflow] {text}", flush=True)


def _connect(address: str, timeout: float) -> Store:
    """A client of the board; waits up to `timeout` for it to come up (the leader's pod may
    start later, and starts its board with its pipeline or its first multi-node launch)."""
    host, port = board_address(address)
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            # A plain connection first: until the leader listens (or its name resolves),
            # retrying here stays quiet, where the store's client would log every attempt.
            socket.create_connection((host, port), timeout=5).close()
            store_cls = import_tcp_store()
            store = store_cls(
                host, port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S)
            )
            return Store(store, address)
        except (OSError, RuntimeError) as exc:
            last = first_line(str(exc)) or type(exc).__name__
        if time.monotonic() >= deadline:
            raise BoardNotUp(
                f"no launch board at {address} after {timeout:g}s ({FOLLOW_TIMEOUT_ENV}; last "
                f"error: {last}): is the leader (node 0) running, with {BOARD_ENV} set alike?"
            )
        time.sleep(min(CONNECT_RETRY_S, max(0.0, deadline - time.monotonic())))


class _Terminated(Exception):
    """SIGTERM reached the follower (its pod is being stopped)."""


def _stop_runs(runs: list[_Run], graceful: bool) -> None:
    """End the launches still running here.

    `graceful` (this follower was asked to stop: its pod is being stopped, as the leader's is):
    as a preemption, the ranks get `stop_grace` for a final checkpoint they take together with
    the leader's. Otherwise the leader is gone or done, and nothing it led can finish: its
    agents are killed at once.
    """
    live = [r for r in runs if r.running()]
    if graceful:
        for run in live:
            run.stop("this follower node was asked to stop (SIGTERM or Ctrl-C)")
        grace = max((r.options.stop_grace for r in live), default=0.0)
        deadline = time.monotonic() + grace + 2 * SHUTDOWN_GRACE_S
        for run in live:
            run.join(max(0.0, deadline - time.monotonic()))
    # Agents are this process's children, each the leader of its own process group.
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(child.pid) == child.pid:
                kill_process_group(child.pid)
    for run in live:
        run.join(SHUTDOWN_GRACE_S)


def follow(address: str, node: int, timeout: float) -> int:
    """Serve the leader's launches as follower `node` until it is done; the exit status."""
    store = _connect(address, timeout)
    store.set(f"follower/{node}", str(os.getpid()))
    store.add("followers", 1)
    _say(f"node {node} follows the launch board at {address}")
    # The runs' stop files, created only to stop one: removed with the folder at the end.
    folder = stop_path(f"follow-{node}")
    runs: list[_Run] = []
    number = 0
    graceful = False
    try:
        while True:
            key = f"launch/{number}"
            if store.has(key):
                blob = store.get(key)
                run = _start(store, number, blob, node, folder)
                if run is not None:
                    runs.append(run)
                number += 1
                continue
            runs = [run for run in runs if run.running()]
            for run in runs:
                run.watch_leader()
            if store.has("done"):
                _say(f"the leader is done after {number} launch(es); node {node} exits")
                return 0
            time.sleep(POLL_S)
    except (_Terminated, KeyboardInterrupt):
        graceful = True
        raise
    finally:
        # The leader, at its end, waits for every follower that has not left yet.
        with contextlib.suppress(BoardGone):
            store.add("byes", 1)
        _stop_runs(runs, graceful)
        shutil.rmtree(folder, ignore_errors=True)


def _start(store: Store, number: int, blob: bytes, node: int, folder: Path) -> _Run | None:
    """Start this node's share of launch `number`, or say why it has none."""
    try:
        record = cloudpickle.loads(blob)
    except Exception as exc:
        error = LaunchError(f"node {node} could not read launch {number}: {exc!r}")
        _say(str(error))
        text = f"LaunchError: {error}"
        store.set(
            f"result/{number}/{node}", cloudpickle.dumps(("error", cloudpickle.dumps(error), text))
        )
        return None
    nodes = node_range(record["options"].nnodes)[1]
    if node >= nodes:
        _say(f"launch {number} runs on {nodes} node(s): node {node} sits it out")
        return None
    if store.has(f"end/{number}"):  # this follower started late; its rendezvous is over
        _say(f"launch {number} already ended on the leader: node {node} skips it")
        return None
    run = _Run(store, number, record, node, folder)
    run.start()
    return run


def _follow_timeout(value: str | None) -> float:
    if not value:
        return DEFAULT_FOLLOW_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise LaunchConfigError(
            f"{FOLLOW_TIMEOUT_ENV}={value!r}: give a positive number of seconds"
        )
    return seconds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainflow.launch.follower",
        description=(
            "Follow the leader of a multi-node job: run this node's share of every multi-node "
            "launch the leader (the process running the flow, on node 0) makes, until it is "
            "done. Run it on every node but the first (pods 1..N-1 of the Kubernetes Indexed "
            "Job); node 0 runs the flow itself with the same "
            f"{BOARD_ENV}, TRAINFLOW_RDZV_ENDPOINT and TRAINFLOW_RUN_ID."
        ),
        epilog=(
            f"environment: {BOARD_ENV}=host:port, the board the leader hosts; "
            f"{NODE_INDEX_ENV}, this node's index (1..N-1); {FOLLOW_TIMEOUT_ENV}, seconds to "
            f"wait for the board to come up (default {DEFAULT_FOLLOW_TIMEOUT_S:g}). "
            "Exit status: 0 when the leader is done; 1 when its board never came up or went "
            "away before it was done; 2 for a usage error; 128+N on signal N."
        ),
    )
    parser.add_argument(
        "--board",
        default=os.environ.get(BOARD_ENV),
        help=f"host:port of the leader's launch board (default: ${BOARD_ENV})",
    )
    parser.add_argument(
        "--node",
        type=int,
        default=None,
        help=f"this node's index, 1..N-1 (default: ${NODE_INDEX_ENV})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"seconds to wait for the board to come up (default: ${FOLLOW_TIMEOUT_ENV} or "
        f"{DEFAULT_FOLLOW_TIMEOUT_S:g})",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if not args.board:
            raise LaunchConfigError(f"no launch board: set {BOARD_ENV}=host:port or pass --board")
        board_address(args.board)
        node = args.node if args.node is not None else node_index()
        if node is None or node < 1:
            raise LaunchConfigError(
                f"this node's index is {node}: followers are nodes 1..N-1 (set "
                f"{NODE_INDEX_ENV} or pass --node); node 0 runs the flow and leads"
            )
        timeout = (
            args.timeout
            if args.timeout is not None
            else _follow_timeout(os.environ.get(FOLLOW_TIMEOUT_ENV))
        )
        if not timeout > 0:
            raise LaunchConfigError(f"--timeout {timeout}: give a positive number of seconds")
    except LaunchConfigError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")

    def terminate(signum: int, _frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one ends this process at once
        raise _Terminated(signum)

    signal.signal(signal.SIGTERM, terminate)
    _quiet_store_logs()
    try:
        return follow(args.board, node, timeout)
    except BoardNotUp as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except BoardGone as exc:
        print(
            f"{parser.prog}: error: {exc} before the leader said it was done: the leader "
            "(node 0) ended abnormally; this node's launches were stopped",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except _Terminated:
        print(f"{parser.prog}: stopped by SIGTERM", file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def _quiet_store_logs() -> None:
    """Load torch with its C++ log level at FATAL: the store client logs every failed request
    (a leader that went away) at length, where one line says it. Children (agents, ranks) get
    the environment as it was."""
    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import_tcp_store()
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


if __name__ == "__main__":
    sys.exit(main())
