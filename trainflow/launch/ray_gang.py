"""One gang of Ray nodes: an actor in each bundle of a placement group runs that node's share
of the launch (`LocalLaunch`); the caller forwards their rank lines and decides how the gang
ended (`trainflow.launch.ray_placement` places the gangs)."""

import collections
import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle

from trainflow.errors import (
    LaunchError,
    StopRequested,
    failure_rank,
    first_line,
    is_root_cause,
)
from trainflow.launch.local import LocalLaunch
from trainflow.launch.plan import LaunchPlan
from trainflow.launch.run_dir import request_stop, stop_path
from trainflow.launch.ship import Shipment
from trainflow.launch.spec import LaunchOptions, LaunchResult, LineSink

logger = logging.getLogger("trainflow.launch.ray_placement")

# How often a gang below its range's largest size looks for room for another node.
GROW_CHECK_S = 5.0
# How long a node's actor holds a poll open waiting for rank lines.
POLL_WAIT_S = 0.5
# A node whose actor has not answered for this long is taken as lost.
NODE_SILENT_S = 30.0
# After the first node reports a failure, how long the others get to report theirs (a lost
# node shows first as its peers' collective errors, then as its actor's death).
FAILURE_GRACE_S = 10.0
# The caller's variables every node's ranks get, as ranks of a local launch inherit them.
FORWARDED_PREFIXES = ("TRAINFLOW_", "MLFLOW_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "WANDB_")
RAY_NODE_ID_ENV = "TRAINFLOW_RAY_NODE_ID"


class _NodeRunner:
    """Runs one node's share of a launch (a Ray actor, one per bundle)."""

    def __init__(self) -> None:
        self.lines: collections.deque[tuple[int, str]] = collections.deque()
        self.outcome: tuple | None = None
        self.news = threading.Condition()  # lines or an outcome arrived
        # Created only when the caller stops this node, removed when its launch ends.
        self.stop_file = str(stop_path("node"))
        self.thread: threading.Thread | None = None

    def describe(self) -> dict[str, Any]:
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
        }

    def free_port(self, ip: str) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((ip, 0))
            return int(sock.getsockname()[1])

    def start(
        self,
        shipment: Shipment,
        options: LaunchOptions,
        rendezvous: tuple[str, str, bool],
        env: dict[str, str],
    ) -> None:
        os.environ.update({k: v for k, v in env.items() if k.startswith("TRAINFLOW_")})
        self.stop_file = str(stop_path("node"))  # under the caller's TRAINFLOW_HOME
        node_options = dataclasses.replace(
            options, max_restarts=0, ray_address=None, stop_file=self.stop_file, env=env
        )

        def sink(rank: int, line: str) -> None:
            with self.news:
                self.lines.append((rank, line))
                self.news.notify_all()

        def run() -> None:
            try:
                result = LocalLaunch(node_options, sink, rendezvous).run(shipment)
                values = cloudpickle.dumps(result.values)
                self.outcome = ("ok", result.ranks, values, str(result.run_dir))
            except BaseException as exc:  # reported to the caller, which decides
                try:
                    self.outcome = ("error", cloudpickle.dumps(exc))
                except Exception:
                    self.outcome = ("error", cloudpickle.dumps(LaunchError(repr(exc))))
            finally:
                Path(self.stop_file).unlink(missing_ok=True)
            with self.news:
                self.news.notify_all()

        self.thread = threading.Thread(target=run, name="node-launch", daemon=True)
        self.thread.start()

    def poll(
        self, wait: float = POLL_WAIT_S, max_lines: int = 2000
    ) -> tuple[list[tuple[int, str]], tuple | None]:
        """New rank lines, and the outcome once the launch ended; waits up to `wait` for news
        (a long poll: the caller asks again at once, without a busy loop)."""
        with self.news:
            self.news.wait_for(lambda: bool(self.lines) or self.outcome is not None, wait)
        lines: list[tuple[int, str]] = []
        while self.lines and len(lines) < max_lines:
            lines.append(self.lines.popleft())
        outcome = self.outcome if not self.lines else None
        return lines, outcome

    def stop(self) -> None:
        """Ask this node's ranks to stop as a preemption would (final checkpoint, then end)."""
        request_stop(Path(self.stop_file))


@dataclasses.dataclass
class _Node:
    index: int
    actor: Any
    info: dict[str, Any]
    ref: Any = None  # the poll in flight
    answered_at: float = 0.0
    ranks: set[int] = dataclasses.field(default_factory=set)
    outcome: tuple | None = None
    lost: str | None = None

    def name(self) -> str:
        ranks = f", ranks {sorted(self.ranks)}" if self.ranks else ""
        return (
            f"node {self.index} (Ray node {self.info.get('node_id', '?')[:12]} on "
            f"{self.info.get('hostname', '?')} {self.info.get('ip', '?')}{ranks})"
        )


class Grow(Exception):
    """The gang stopped to re-form on more nodes (not a failure: no restart is used)."""


class NodeLostError(LaunchError):
    """A node of a multi-node launch died (its Ray node, its actor, or all its processes)."""


def forwarded_env(options: LaunchOptions) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}
    env.update(options.env)
    return env


class Gang:
    """The nodes of one placement group, each running its node launch."""

    def __init__(
        self,
        ray: Any,
        options: LaunchOptions,
        plan: LaunchPlan,
        actor_resources: dict[str, Any],
        emit: LineSink,
    ):
        self.ray = ray
        self.options = options
        self.plan = plan
        self.actor_resources = actor_resources
        self.emit = emit
        self.nodes: list[_Node] = []

    def start(self, pg: Any, size: int, shipment: Shipment) -> None:
        """Start a node launch in each of the `size` bundles of `pg`, the first hosting the
        rendezvous."""
        ray = self.ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        runner = ray.remote(_NodeRunner)
        actors = [
            runner.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=i
                ),
                max_restarts=0,
                max_concurrency=4,
                **self.actor_resources,
            ).remote()
            for i in range(size)
        ]
        infos = ray.get([a.describe.remote() for a in actors], timeout=120)
        nodes = [_Node(i, a, info) for i, (a, info) in enumerate(zip(actors, infos, strict=True))]
        self.nodes = nodes
        host = infos[0]["ip"]
        port = ray.get(actors[0].free_port.remote(host), timeout=60)
        run_id = uuid.uuid4().hex
        node_options = dataclasses.replace(
            self.options,
            gpus=self.plan.nproc_per_node * size,
            gpu_type=self.options.gpu_type,
            nnodes=size,
        )
        env = forwarded_env(self.options)
        if self.plan.device == "cpu" and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = "1"  # each rank has the one CPU its bundle reserved
        ray.get(
            [
                n.actor.start.remote(
                    shipment,
                    node_options,
                    (f"{host}:{port}", run_id, n.index == 0),
                    {**env, RAY_NODE_ID_ENV: n.info["node_id"]},
                )
                for n in nodes
            ],
            timeout=120,
        )
        now = time.monotonic()
        for n in nodes:
            n.answered_at = now
        logger.info(
            "placed %d node(s) on Ray: %s; rendezvous %s:%s",
            size,
            ", ".join(n.name() for n in nodes),
            host,
            port,
        )

    def poll(self) -> None:
        """Forward the rank lines the nodes have; note outcomes and lost nodes."""
        ray = self.ray
        live = [n for n in self.nodes if n.lost is None and n.outcome is None]
        for n in live:
            if n.ref is None:
                n.ref = n.actor.poll.remote()
        refs = [n.ref for n in live]
        if not refs:
            return
        ready, _ = ray.wait(refs, num_returns=1, timeout=0.2)
        ready_set = set(ready)
        now = time.monotonic()
        for n in live:
            if n.ref not in ready_set:
                if now - n.answered_at > NODE_SILENT_S:
                    n.lost = f"its actor has not answered for {NODE_SILENT_S:.0f}s"
                continue
            ref, n.ref = n.ref, None
            try:
                lines, outcome = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError) as exc:
                n.lost = first_line(str(exc))
                continue
            n.answered_at = now
            for rank, line in lines:
                n.ranks.add(rank)
                self.emit(rank, line)
            if outcome is not None:
                n.outcome = outcome

    def stop(self, grace: float) -> None:
        """Ask every node to stop (final checkpoint), wait up to `grace`, then kill them."""
        for n in self.nodes:
            if n.lost is None and n.outcome is None:
                with contextlib.suppress(Exception):
                    n.actor.stop.remote()
        deadline = time.monotonic() + grace
        try:
            while time.monotonic() < deadline and any(
                n.lost is None and n.outcome is None for n in self.nodes
            ):
                self.poll()
        except KeyboardInterrupt:
            pass  # asked twice: stop waiting

    def kill(self) -> None:
        for n in self.nodes:
            with contextlib.suppress(Exception):
                self.ray.kill(n.actor, no_restart=True)

    @property
    def may_grow(self) -> bool:
        """An elastic range below its largest size, with restarts allowed (the function
        continues from its checkpoints), grows when the cluster has room for another node."""
        low, high = self.plan.min_nodes or self.plan.nnodes, self.plan.nnodes
        return low < high and len(self.nodes) < high and self.options.max_restarts > 0

    def run(self, room_to_grow: Callable[[], bool]) -> LaunchResult:
        """Watch the gang until every node succeeded (its result), one failed (its error), the
        caller's stop file appeared, or `room_to_grow()` says a larger gang fits (`Grow`)."""
        nodes = self.nodes
        failed_at: float | None = None
        user_stop = self.options.stop_file
        next_grow_check = time.monotonic() + GROW_CHECK_S
        while True:
            self.poll()
            if all(n.outcome is not None and n.outcome[0] == "ok" for n in nodes):
                return gang_result(self.nodes, self.plan)
            now = time.monotonic()
            if failed_at is None and now >= next_grow_check and self.may_grow:
                next_grow_check = now + GROW_CHECK_S
                if room_to_grow():
                    # Stop as for a preemption (a final checkpoint), then re-form larger.
                    self.stop(self.options.stop_grace + 5)
                    if all(n.outcome is not None and n.outcome[0] == "ok" for n in nodes):
                        return gang_result(self.nodes, self.plan)  # it finished meanwhile
                    raise Grow(f"a node joined: growing from {len(nodes)} node(s)")
            bad = [n for n in nodes if n.lost or (n.outcome and n.outcome[0] == "error")]
            if bad and failed_at is None:
                failed_at = time.monotonic()
            # A rank's own error is the cause: no need to hear from the others. A lost peer
            # shows first as collective errors elsewhere, so those wait for the whole story.
            # Either way the other nodes' ranks are then stopped, never waited for.
            settled = all(n.lost or n.outcome for n in nodes) or any(
                is_root_cause(cloudpickle.loads(n.outcome[1])) for n in bad if n.outcome is not None
            )
            if failed_at is not None and (
                settled or time.monotonic() - failed_at > FAILURE_GRACE_S
            ):
                raise gang_failure(self.nodes)
            if user_stop and os.path.exists(user_stop):
                self.stop(self.options.stop_grace + 5)
                raise StopRequested(
                    f"stopped on request ({user_stop} appeared); the ranks checkpointed at the "
                    "step they reached",
                )


def gang_failure(nodes: list[_Node]) -> LaunchError:
    """The error a failed gang raises: a lost node first, else the first real cause."""
    lost = [n for n in nodes if n.lost]
    errors = [
        (n, cloudpickle.loads(n.outcome[1]))
        for n in nodes
        if n.outcome is not None and n.outcome[0] == "error"
    ]
    if lost:
        first = lost[0]
        others = "".join(f"\n{n.name()} then failed: {first_line(str(e))}" for n, e in errors)
        return NodeLostError(
            f"{first.name()} was lost: {first.lost}.{others}\nThe other nodes' ranks were stopped."
        )

    node, exc = sorted(errors, key=lambda item: failure_rank(item[1]))[0]
    if isinstance(exc, LaunchError):
        exc.args = (f"on {node.name()}: {exc.args[0] if exc.args else exc}", *exc.args[1:])
        return exc
    return LaunchError(f"on {node.name()}: {exc!r}")


def gang_result(nodes: list[_Node], plan: LaunchPlan) -> LaunchResult:
    """Every node's values, ordered by global rank, once all succeeded."""
    values: dict[int, Any] = {}
    log_files: dict[int, Path] = {}
    for n in nodes:
        assert n.outcome is not None
        _, ranks, blob, run_dir = n.outcome
        for rank, value in zip(ranks, cloudpickle.loads(blob), strict=True):
            values[rank] = value
            log_files[rank] = Path(run_dir) / "logs" / f"rank_{rank}.log"
    world = plan.nproc_per_node * len(nodes)
    missing = sorted(set(range(world)) - set(values))
    if missing:
        raise LaunchError(f"ranks without a result after every node finished: {missing}")
    plan = dataclasses.replace(plan, nnodes=len(nodes))
    first = nodes[0].outcome
    assert first is not None
    return LaunchResult(
        [values[r] for r in sorted(values)],
        Path(first[3]),
        log_files,
        plan,
        sorted(values),
    )
