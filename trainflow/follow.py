"""Follower nodes: the flow runs on the first node only; the other nodes only run launches.

In a multi-node job where every node starts a process (the Kubernetes Indexed Job of
`deployments/k8s-multinode-job-template.json`), the pipeline runs once, on the **leader** (pod
0); the other pods run `python -m trainflow.follow` and are **followers**: the elastic agents of
each launch the leader makes, nothing else.

The protocol is a "launch board", a `torch.distributed.TCPStore` that the leader hosts for its
whole life at `TRAINFLOW_LAUNCH_BOARD=host:port` (on Kubernetes: pod 0's name and a port next
to the rendezvous port):

1. The board is enabled in a process when `TRAINFLOW_LAUNCH_BOARD` is set and the process is
   the leader: `JOB_COMPLETION_INDEX` unset or "0", and not itself a rank or agent of a
   launch. It starts with the process's first multi-node launch that no Ray cluster places
   (or earlier, when the pipeline starts its launch agent ahead: `launcher.standby`).
2. Launch number i (0, 1, 2, ...) of the leader is written under `launch/{i}`: the shipped
   call, the launch options, the rendezvous endpoint (`TRAINFLOW_RDZV_ENDPOINT`) and a run id
   of its own, `{TRAINFLOW_RUN_ID}-{i}`, as a finished c10d rendezvous cannot be joined again.
   The leader then runs its node's share and hosts the rendezvous store.
3. Each follower waits for `launch/{i}`, runs its node's share of it in a thread of its own
   (a later launch is never held up by an earlier one still winding down), prints its ranks'
   lines as `[node K rank N] ...` and writes the outcome under `result/{i}/{node}`: the ranks
   it ran, or its error (pickled). Its ranks return their values to the follower only. A
   follower that starts late skips the launches whose leader share has already ended.
4. When the leader's node launch ends it writes `end/{i}`. After a failure there, a follower
   whose share still runs stops it after `STOP_AFTER_FAILURE_S` (it may wait in a
   rendezvous that will never complete). A follower's failure during the leader's launch
   stops the leader's share too, at once for a rank's own error, after a grace for a
   collective one. The leader's error then names the first real cause: a follower rank's own
   error (not one of waiting on a peer, `errors.is_collective_failure`) wins over the leader
   ranks' collective errors. A follower failing after the leader's share succeeded fails the
   call as well.
5. At normal exit the leader writes `done` and waits (at most `FAREWELL_WAIT_S`) for every
   follower to acknowledge it; followers then exit 0. A board that goes away without `done`
   (the leader died) or never comes up within `TRAINFLOW_FOLLOW_TIMEOUT` seconds (default
   1800) ends a follower with exit status 1 and a one-line message.

A failed launch does not end a follower: the leader decides (a retried task launches again
and needs it). No rank or agent outlives a follower: launches still running when it exits
are stopped, and each agent also ends with its parent.

The board, like torch's rendezvous store, is plain TCP without authentication, and what it
carries runs on the followers: keep its port reachable only from the job's own pods.
"""

import argparse
import atexit
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import cloudpickle
import psutil

from trainflow.errors import (
    LaunchConfigError,
    LaunchError,
    StopRequested,
    failure_rank,
    first_line,
    is_root_cause,
)
from trainflow.launcher import (
    SHUTDOWN_GRACE_S,
    LaunchOptions,
    LaunchResult,
    LineSink,
    Shipment,
    _Launch,
    kill_process_group,
    rank_label,
    ship,
)
from trainflow.resources import node_range

logger = logging.getLogger(__name__)

BOARD_ENV = "TRAINFLOW_LAUNCH_BOARD"
NODE_INDEX_ENV = "JOB_COMPLETION_INDEX"
FOLLOW_TIMEOUT_ENV = "TRAINFLOW_FOLLOW_TIMEOUT"
DEFAULT_FOLLOW_TIMEOUT_S = 1800.0
# How often followers, and the leader during its launch, look at the board.
POLL_S = 0.2
# Follower: how often to try the board until it is up.
CONNECT_RETRY_S = 0.25
# Leader: how long to wait for the followers' outcomes once its own share ended.
REPORT_WAIT_S = 20.0
# Leader: after a follower's collective failure (it lost a peer), how long its own share gets
# to end by itself (with its own error, the more telling one) before it is stopped.
COLLECTIVE_GRACE_S = 10.0
# Follower: after the leader's share failed, how long its own share gets to end by itself.
STOP_AFTER_FAILURE_S = 5.0
# Leader at exit: how long to wait for the followers to acknowledge `done`.
FAREWELL_WAIT_S = 10.0
# Timeout of one request to the board (a lost leader whose connection hangs shows within it).
STORE_TIMEOUT_S = 60.0


class BoardGone(LaunchError):
    """The launch board went away: its host (the leader) ended or cannot be reached."""


class BoardNotUp(BoardGone):
    """No launch board came up at the address within the follower's timeout."""


def board_address(value: str) -> tuple[str, int]:
    """`(host, port)` of a `host:port` board address (`TRAINFLOW_LAUNCH_BOARD`)."""
    host, sep, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchConfigError(f"{BOARD_ENV}={value!r}: give host:port (port 1-65535)")
    return host, int(port)


def node_index() -> int | None:
    """This node's index in the job (`JOB_COMPLETION_INDEX`), None when not set."""
    value = os.environ.get(NODE_INDEX_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise LaunchConfigError(f"{NODE_INDEX_ENV}={value!r}: expected a node index >= 0")
    return int(value)


def board_enabled() -> bool:
    """Whether this process leads: `TRAINFLOW_LAUNCH_BOARD` set, `JOB_COMPLETION_INDEX` unset or
    0, and not an agent or rank of a launch."""
    if not os.environ.get(BOARD_ENV):
        return False
    from trainflow._worker import AGENT_PID_ENV
    from trainflow.runtime import RUN_DIR_ENV

    if os.environ.get(AGENT_PID_ENV) or os.environ.get(RUN_DIR_ENV):
        return False  # an agent or a rank (their environment comes from the leader's)
    return node_index() in (None, 0)


def _import_tcp_store() -> Any:
    from torch.distributed import TCPStore

    return TCPStore


class _Store:
    """A TCPStore shared by threads; a request that fails raises `BoardGone`."""

    def __init__(self, store: Any, address: str):
        self._store = store
        self._lock = threading.Lock()
        self.address = address

    def _call(self, name: str, *args: Any) -> Any:
        with self._lock:
            try:
                return getattr(self._store, name)(*args)
            except (RuntimeError, OSError) as exc:
                raise BoardGone(
                    f"the launch board at {self.address} went away ({first_line(str(exc))})"
                ) from exc

    def has(self, key: str) -> bool:
        return bool(self._call("check", [key]))

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, value)

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))


# -- the leader ------------------------------------------------------------------------------


def _load_outcome(blob: bytes) -> tuple[str, Any]:
    """A follower's `result/{i}/{node}`: ("ok", ranks) or ("error", exception)."""
    try:
        outcome = cloudpickle.loads(blob)
    except Exception as exc:  # a result this process cannot read says the node failed
        return "error", LaunchError(f"its result could not be read: {exc!r}")
    if outcome[0] == "ok":
        return "ok", outcome[1]
    try:
        error = cloudpickle.loads(outcome[1])
    except Exception:  # the exception's class does not import here: its text still does
        error = LaunchError(outcome[2])
    if not isinstance(error, BaseException):
        error = LaunchError(outcome[2])
    return "error", error


def _on_follower(node: int, exc: BaseException) -> BaseException:
    """`exc` of follower `node`, its message saying where it happened."""
    where = f"on follower node {node} ({NODE_INDEX_ENV}={node})"
    if isinstance(exc, LaunchError):
        exc.args = (f"{where}: {exc.args[0] if exc.args else exc}", *exc.args[1:])
        return exc
    error = LaunchError(f"{where}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


class Board:
    """The launch board this process hosts as the leader (one per process, `leader_board`)."""

    def __init__(self, address: str):
        host, port = board_address(address)
        store_cls = _import_tcp_store()
        try:
            store = store_cls(
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=STORE_TIMEOUT_S),
            )
        except (RuntimeError, OSError) as exc:
            raise LaunchConfigError(
                f"cannot host the launch board at {address} ({BOARD_ENV}): {first_line(str(exc))}"
            ) from exc
        self.store = _Store(store, address)
        self.address = address
        self.next = 0
        self.lock = threading.Lock()
        self.closed = False
        self.pid = os.getpid()
        atexit.register(self.close)
        logger.info("hosting the launch board for follower nodes at %s", address)

    def publish(
        self, shipment: Shipment, options: LaunchOptions, endpoint: str, run_id: str
    ) -> tuple[int, str]:
        """Write a launch for the followers; its number and rendezvous run id."""
        with self.lock:
            number = self.next
            self.next += 1
        run_id = f"{run_id}-{number}"
        record = {
            "shipment": shipment,
            "options": options,
            "endpoint": endpoint,
            "run_id": run_id,
        }
        self.store.set(f"launch/{number}", cloudpickle.dumps(record))
        return number, run_id

    def end(self, number: int, ok: bool) -> None:
        """The leader's share of launch `number` ended."""
        with contextlib.suppress(BoardGone):
            self.store.set(f"end/{number}", "ok" if ok else "failed")

    def followers(self, nodes: int) -> list[int]:
        """Follower nodes (1 .. nodes-1) connected to the board."""
        return [k for k in range(1, nodes) if self.store.has(f"follower/{k}")]

    def outcomes(self, number: int, nodes: int) -> dict[int, tuple[str, Any]]:
        """The outcomes of launch `number` its followers (1 .. nodes-1) have written so far."""
        found = {}
        for k in range(1, nodes):
            key = f"result/{number}/{k}"
            if self.store.has(key):
                found[k] = _load_outcome(self.store.get(key))
        return found

    def close(self) -> None:
        """Tell the followers the leader is done, and wait (bounded) until each has read it
        (or has left already)."""
        if self.closed or os.getpid() != self.pid:  # a forked child is not the leader
            return
        self.closed = True
        with contextlib.suppress(BoardGone):
            self.store.set("done", "1")
            deadline = time.monotonic() + FAREWELL_WAIT_S
            while time.monotonic() < deadline:
                if self.store.add("byes", 0) >= self.store.add("followers", 0):
                    return
                time.sleep(0.05)
            logger.warning(
                "not every follower node acknowledged the end of the run within %.0fs",
                FAREWELL_WAIT_S,
            )


_board: Board | None = None
_board_lock = threading.Lock()


def leader_board() -> Board | None:
    """The launch board of this process when it leads (`board_enabled`), started on first use.

    Raises:
        LaunchConfigError: the address is malformed or its port cannot be listened on.
    """
    global _board
    if not board_enabled():
        return None
    with _board_lock:
        if _board is None:
            _board = Board(os.environ[BOARD_ENV])
        return _board


class _Watch:
    """Watches the followers (and the caller's stop file) while the leader's share runs.

    A follower's failure, or the caller's stop file, makes the leader's share stop through its
    own stop file: it would otherwise wait on peers that are gone (up to the collective or
    rendezvous timeout).
    """

    def __init__(self, board: Board, number: int, nodes: int, user_stop: str | None, stop: Path):
        self.board = board
        self.number = number
        self.nodes = nodes
        self.user_stop = user_stop
        self.stop = stop
        self.user_stopped = False
        self.failure: tuple[int, BaseException] | None = None
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._run, name="launch-board-watch", daemon=True)

    def __enter__(self) -> "_Watch":
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.finished.set()
        self.thread.join()

    def _run(self) -> None:
        first_error_at: float | None = None
        while not self.finished.wait(POLL_S):
            if self.user_stop and os.path.exists(self.user_stop):
                self.user_stopped = True
                self.stop.touch()
                return
            try:
                outcomes = self.board.outcomes(self.number, self.nodes)
            except BoardGone:
                return
            errors = [(k, o[1]) for k, o in outcomes.items() if o[0] == "error"]
            if not errors:
                continue
            node, exc = min(errors, key=lambda e: failure_rank(e[1]))
            first_error_at = first_error_at or time.monotonic()
            if failure_rank(exc) == 1 and time.monotonic() - first_error_at < COLLECTIVE_GRACE_S:
                continue  # it lost a peer: the leader's own share may say which, and why
            self.failure = (node, exc)
            self.stop.touch()
            return


def _choose(own: LaunchError, followers: dict[int, BaseException]) -> BaseException:
    """The error to raise: the first real cause, the leader's own on a tie."""
    candidates: list[tuple[int, int, BaseException]] = [(failure_rank(own), 0, own)]
    candidates += [(failure_rank(e), k, e) for k, e in sorted(followers.items())]
    _, node, exc = min(candidates, key=lambda c: (c[0], c[1]))
    return exc if node == 0 else _on_follower(node, exc)


def _wait_outcomes(
    board: Board, number: int, nodes: int, stop_early: Callable[[dict], bool]
) -> tuple[dict[int, tuple[str, Any]], list[int]]:
    """The outcomes of launch `number` from the connected followers, once all are in,
    `stop_early` says so, or after `REPORT_WAIT_S`; and the followers without one."""
    deadline = time.monotonic() + REPORT_WAIT_S
    outcomes: dict[int, tuple[str, Any]] = {}
    expected: list[int] = []
    while True:
        with contextlib.suppress(BoardGone):
            expected = board.followers(nodes)
            outcomes = board.outcomes(number, nodes)
        missing = [k for k in expected if k not in outcomes]
        if not missing or stop_early(outcomes) or time.monotonic() > deadline:
            return outcomes, missing
        time.sleep(POLL_S)


def lead(
    board: Board,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    options: LaunchOptions,
    on_line: LineSink | None = None,
) -> LaunchResult:
    """Run `fn(*args, **kwargs)` as the leader: publish it to the followers, run this node's
    share (hosting the rendezvous), and return this node's ranks' values.

    Raises what a local launch raises; a follower's error, named by its node, when it is the
    first real cause (see the module doc).
    """
    shipment = ship(fn, args, kwargs)  # a call that cannot travel fails before it is published

    def print_line(rank: int, line: str) -> None:
        print(f"{rank_label(rank, options)} {line}", flush=True)

    sink = on_line or print_line
    endpoint, base_run_id = _Launch(None, options, sink)._rendezvous()
    nodes = node_range(options.nnodes)[1]
    number, run_id = board.publish(shipment, options, endpoint, base_run_id)
    logger.info(
        "launch %d published to follower node(s) %s; rendezvous %s, run id %s",
        number,
        board.followers(nodes),
        endpoint,
        run_id,
    )
    folder = Path(tempfile.mkdtemp(prefix="trainflow-lead-"))
    stop = folder / "stop"
    mine = dataclasses.replace(options, stop_file=str(stop))
    own: LaunchError | None = None
    try:
        with _Watch(board, number, nodes, options.stop_file, stop) as watch:
            try:
                result = _Launch(None, mine, sink, (endpoint, run_id, True)).run_shipment(shipment)
            except LaunchError as exc:
                own = exc
    except BaseException:  # interrupted: followers still running stop soon
        board.end(number, ok=False)
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    board.end(number, ok=own is None)
    if own is None:
        outcomes, missing = _wait_outcomes(
            board, number, nodes, lambda found: any(o[0] == "error" for o in found.values())
        )
        errors = {k: o[1] for k, o in outcomes.items() if o[0] == "error"}
        if errors:
            node = min(errors, key=lambda k: (failure_rank(errors[k]), k))
            raise _on_follower(node, errors[node])
        if missing:
            logger.warning(
                "launch %d: follower node(s) %s reported no outcome within %.0fs",
                number,
                missing,
                REPORT_WAIT_S,
            )
        return result
    if isinstance(own, StopRequested) and watch.user_stopped:
        raise StopRequested(
            f"stopped on request ({options.stop_file} appeared); the ranks checkpointed at the "
            f"step they reached. Rank logs: {own.log_dir}",
            log_dir=own.log_dir,
        ) from None
    if isinstance(own, StopRequested) and watch.failure is not None:
        raise _on_follower(*watch.failure) from None
    if is_root_cause(own):
        raise own
    outcomes, _ = _wait_outcomes(
        board,
        number,
        nodes,
        lambda found: any(o[0] == "error" and is_root_cause(o[1]) for o in found.values()),
    )
    raise _choose(own, {k: o[1] for k, o in outcomes.items() if o[0] == "error"})


# -- a follower ------------------------------------------------------------------------------


class _Run:
    """One launch on this follower: this node's share, run in a thread of its own."""

    def __init__(self, store: _Store, number: int, record: dict, node: int, folder: Path):
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
            launch = _Launch(None, self.options, self._print, (self.endpoint, self.run_id, False))
            result = launch.run_shipment(self.shipment)
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
        self.stop_file.touch()

    def join(self, seconds: float) -> None:
        self.thread.join(seconds)


def _say(text: str) -> None:
    print(f"[trainflow] {text}", flush=True)


def _connect(address: str, timeout: float) -> _Store:
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
            store_cls = _import_tcp_store()
            store = store_cls(
                host, port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S)
            )
            return _Store(store, address)
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
    folder = Path(tempfile.mkdtemp(prefix=f"trainflow-follow-{node}-"))
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


def _start(store: _Store, number: int, blob: bytes, node: int, folder: Path) -> _Run | None:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainflow.follow",
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
        _import_tcp_store()
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


if __name__ == "__main__":
    sys.exit(main())
