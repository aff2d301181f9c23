"""Follower nodes: the flow runs on the first node only; the other nodes only run launches.

In a multi-node job where every node starts a process (the Kubernetes Indexed Job of
`deployments/k8s-multinode-job-template.json`), the pipeline runs once, on the **leader**
(pod 0); the other pods run `python -m trainflow.launch.follower` (`trainflow.launch.follower`)
and are **followers**: the elastic agents of each launch the leader makes, nothing else.

The protocol is a "launch board", a `torch.distributed.TCPStore` that the leader hosts for its
whole life at `TRAINFLOW_LAUNCH_BOARD=host:port` (on Kubernetes: pod 0's name and a port next
to the rendezvous port):

1. The board is enabled in a process when `TRAINFLOW_LAUNCH_BOARD` is set and the process is
   the leader: `JOB_COMPLETION_INDEX` unset or "0", and not itself a rank or agent of a
   launch. It starts with the process's first multi-node launch that no Ray cluster places
   (or earlier, when the pipeline starts its launch agent ahead: `backends.standby`).
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

import atexit
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import cloudpickle

from trainflow.errors import (
    LaunchConfigError,
    LaunchError,
    StopRequested,
    failure_rank,
    first_line,
    is_root_cause,
)
from trainflow.launch.listen import node_address, tcp_store_server
from trainflow.launch.local import LocalLaunch
from trainflow.launch.plan import node_range
from trainflow.launch.run_dir import request_stop, stop_path
from trainflow.launch.ship import Shipment
from trainflow.launch.spec import (
    AGENT_PID_ENV,
    RUN_DIR_ENV,
    LaunchOptions,
    LaunchResult,
    LineSink,
    rank_label,
)

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
    if os.environ.get(AGENT_PID_ENV) or os.environ.get(RUN_DIR_ENV):
        return False  # an agent or a rank (their environment comes from the leader's)
    return node_index() in (None, 0)


def import_tcp_store() -> Any:
    from torch.distributed import TCPStore

    return TCPStore


class Store:
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
        store_cls = import_tcp_store()
        try:
            # Only on the address followers reach it through, not every interface.
            store = tcp_store_server(
                store_cls,
                node_address(host),
                port,
                wait_for_workers=False,
                timeout=timedelta(seconds=STORE_TIMEOUT_S),
            )
        except (RuntimeError, OSError) as exc:
            raise LaunchConfigError(
                f"cannot host the launch board at {address} ({BOARD_ENV}): {first_line(str(exc))}"
            ) from exc
        self.store = Store(store, address)
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
                request_stop(self.stop)
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
            request_stop(self.stop)
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
    board: Board, shipment: Shipment, options: LaunchOptions, on_line: LineSink | None = None
) -> LaunchResult:
    """Run `shipment` as the leader: publish it to the followers, run this node's share
    (hosting the rendezvous), and return this node's ranks' values.

    Raises what a local launch raises; a follower's error, named by its node, when it is the
    first real cause (see the module doc).
    """

    def print_line(rank: int, line: str) -> None:
        print(f"{rank_label(rank, options)} {line}", flush=True)

    sink = on_line or print_line
    endpoint, base_run_id = LocalLaunch(options, sink).rendezvous()
    nodes = node_range(options.nnodes)[1]
    number, run_id = board.publish(shipment, options, endpoint, base_run_id)
    logger.info(
        "launch %d published to follower node(s) %s; rendezvous %s, run id %s",
        number,
        board.followers(nodes),
        endpoint,
        run_id,
    )
    stop = stop_path("lead")  # created only to stop this node's share
    mine = dataclasses.replace(options, stop_file=str(stop))
    own: LaunchError | None = None
    try:
        with _Watch(board, number, nodes, options.stop_file, stop) as watch:
            try:
                result = LocalLaunch(mine, sink, (endpoint, run_id, True)).run(shipment)
            except LaunchError as exc:
                own = exc
    except BaseException:  # interrupted: followers still running stop soon
        board.end(number, ok=False)
        raise
    finally:
        stop.unlink(missing_ok=True)
    board.end(number, ok=own is None)
    if own is None:
        return _after_success(board, number, nodes, result)
    raise _leader_failure(board, number, nodes, options, own, watch)


def _after_success(board: Board, number: int, nodes: int, result: LaunchResult) -> LaunchResult:
    """The leader's share succeeded: the call's result, unless a follower's failed."""
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


def _leader_failure(
    board: Board, number: int, nodes: int, options: LaunchOptions, own: LaunchError, watch: _Watch
) -> BaseException:
    """The leader's share failed with `own`: the error the call raises, the first real cause
    across the nodes."""
    if isinstance(own, StopRequested) and watch.user_stopped:
        return StopRequested(
            f"stopped on request ({options.stop_file} appeared); the ranks checkpointed at the "
            f"step they reached. Rank logs: {own.log_dir}",
            log_dir=own.log_dir,
        )
    if isinstance(own, StopRequested) and watch.failure is not None:
        return _on_follower(*watch.failure)
    if is_root_cause(own):
        return own
    outcomes, _ = _wait_outcomes(
        board,
        number,
        nodes,
        lambda found: any(o[0] == "error" and is_root_cause(o[1]) for o in found.values()),
    )
    return _choose(own, {k: o[1] for k, o in outcomes.items() if o[0] == "error"})
