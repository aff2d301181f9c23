"""Multi-node launches placed by a Ray cluster, with the local launcher's code on every node.

`@distributed(gpus=16, nnodes=2)` with `RAY_ADDRESS` set (or `ray_address=` given) runs here:

1. **Gang scheduling.** One placement group with a bundle per node (its GPUs, or one CPU per
   CPU rank), strategy `STRICT_SPREAD`: every node is reserved before any rank starts, each on
   a different Ray node. Placement is by Ray node, not by IP, so two Ray nodes behind one
   address still get distinct node ranks.
2. **One elastic agent per node.** A small Ray actor in each bundle runs the same supervised
   launch as a single-machine call (`trainflow.launcher`): torch's elastic agent in its own
   process group, the ranks' logs, errors, heartbeats, stop requests and cleanup. The nodes
   meet in a c10d rendezvous hosted on the first node.
3. **One result.** The caller forwards every rank's lines (`[node K rank N]`), gathers the
   per-rank values ordered by global rank, and turns the first real failure into one error.
   A node that is lost (its actor or Ray node dies) ends the launch with an error naming it,
   and the other nodes' ranks are stopped at once: no rank is left waiting on a dead peer.
4. **Recovery.** With `max_restarts > 0`, a lost node or a failure a relaunch can fix
   (`errors.is_transient`) re-forms the gang (a new placement group, so Ray may give a
   replacement node) and runs the function again; it continues from its latest checkpoint.
   With an elastic range (`nnodes="2:4"`), each gang takes as many nodes as the cluster can
   give within the range, so a run that lost a node goes on with fewer.
5. **Cleanup.** The placement group is removed and every actor killed on every path; an
   actor's death takes its agent and ranks with it (the agent watches its parent).

Ray is optional (`pip install 'trainflow[ray]'`): nothing here imports it until a launch asks
for a cluster.
"""

import collections
import contextlib
import dataclasses
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
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
    is_transient,
)
from trainflow.launcher import (
    LaunchOptions,
    LaunchResult,
    LineSink,
    Shipment,
    _Launch,
    rank_label,
    ship,
)
from trainflow.resources import LaunchPlan, cluster_plan, ray_cluster_address

logger = logging.getLogger(__name__)

# Seconds to wait for the cluster to reserve every node of a gang (an autoscaler may be adding
# nodes); past it the launch fails, naming what was asked and what the cluster has.
PLACEMENT_TIMEOUT_ENV = "TRAINFLOW_RAY_PLACEMENT_TIMEOUT"
DEFAULT_PLACEMENT_TIMEOUT_S = 300.0
# With an elastic range, how long to try a larger gang before settling for fewer nodes.
RANGE_STEP_TIMEOUT_S = 10.0
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


def ray_address(options: LaunchOptions) -> str | None:
    """The Ray cluster a launch goes to (`resources.ray_cluster_address`)."""
    return ray_cluster_address(options.nnodes, options.ray_address)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise LaunchConfigError(
            "a Ray cluster is configured (ray_address or RAY_ADDRESS) but Ray is not installed: "
            "pip install 'trainflow[ray]'"
        ) from exc
    return ray


def _placement_timeout() -> float:
    value = os.environ.get(PLACEMENT_TIMEOUT_ENV, "")
    if not value:
        return DEFAULT_PLACEMENT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1
    if seconds <= 0:
        raise LaunchConfigError(f"{PLACEMENT_TIMEOUT_ENV}={value!r}: give a positive number")
    return seconds


class _NodeRunner:
    """Runs one node's share of a launch (a Ray actor, one per bundle)."""

    def __init__(self) -> None:
        self.lines: collections.deque[tuple[int, str]] = collections.deque()
        self.outcome: tuple | None = None
        self.news = threading.Condition()  # lines or an outcome arrived
        self.folder = tempfile.mkdtemp(prefix="trainflow-node-")
        self.stop_file = os.path.join(self.folder, "stop")
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
        node_options = dataclasses.replace(
            options, max_restarts=0, ray_address=None, stop_file=self.stop_file, env=env
        )
        os.environ.update({k: v for k, v in env.items() if k.startswith("TRAINFLOW_")})

        def sink(rank: int, line: str) -> None:
            with self.news:
                self.lines.append((rank, line))
                self.news.notify_all()

        def run() -> None:
            try:
                result = _Launch(None, node_options, sink, rendezvous).run_shipment(shipment)
                values = cloudpickle.dumps(result.values)
                self.outcome = ("ok", result.ranks, values, str(result.run_dir))
            except BaseException as exc:  # reported to the caller, which decides
                try:
                    self.outcome = ("error", cloudpickle.dumps(exc))
                except Exception:
                    self.outcome = ("error", cloudpickle.dumps(LaunchError(repr(exc))))
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
        Path(self.stop_file).touch()


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


class _Grow(Exception):
    """The gang stopped to re-form on more nodes (not a failure: no restart is used)."""


class NodeLostError(LaunchError):
    """A node of a multi-node launch died (its Ray node, its actor, or all its processes)."""


def _forwarded_env(options: LaunchOptions) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}
    env.update(options.env)
    return env


def _bundle(plan: LaunchPlan) -> tuple[dict[str, float], dict[str, Any]]:
    """One node's bundle and its actor's resource options."""
    per_node = plan.nproc_per_node
    if plan.device == "cuda":
        return {"GPU": per_node, "CPU": 1}, {"num_gpus": per_node, "num_cpus": 1}
    return {"CPU": per_node}, {"num_cpus": per_node}


def resolve_plan(options: LaunchOptions) -> LaunchPlan:
    """The plan at the largest size; the cluster's nodes have the GPUs, not this machine."""
    address = ray_address(options) or "ray"
    return cluster_plan(options.gpus, options.gpu_type, options.nnodes, address)


class RayLaunch:
    """A launch on a Ray cluster: place the gang, run a node launch in each bundle, gather."""

    def __init__(self, options: LaunchOptions, sink: LineSink | None):
        self.options = options
        self.user_sink = sink
        self.address = ray_address(options)
        self.plan = resolve_plan(options)
        self.bundle, self.actor_resources = _bundle(self.plan)
        self.ray = _import_ray()

    # -- lines ---------------------------------------------------------------------------
    def _emit(self, rank: int, line: str) -> None:
        if self.user_sink is None:
            print(f"{rank_label(rank, self.options)} {line}", flush=True)
        else:
            self.user_sink(rank, line)

    # -- connection and placement --------------------------------------------------------
    def _connect(self) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        ray.init(
            address=self.address,
            log_to_driver=False,
            logging_level=logging.WARNING,
            configure_logging=False,
        )

    def _nodes_that_fit(self, exclude: set[str], free_now: bool = True) -> int:
        """Alive Ray nodes (not known lost) with room for one bundle: free now, or in all."""
        try:
            from ray._private import state

            free: dict[str, dict[str, float]] | None = (
                state.available_resources_per_node() if free_now else None
            )
        except Exception:  # Ray cannot say what is free: count what the nodes have
            free = None
        count = 0
        for node in self.ray.nodes():
            node_id = node.get("NodeID", "")
            if not node.get("Alive") or node_id in exclude:
                continue
            have = node.get("Resources", {}) if free is None else free.get(node_id, {})
            if all(have.get(k, 0) >= v for k, v in self.bundle.items()):
                count += 1
        return count

    def _place(self, exclude: set[str], at_least: int = 0) -> tuple[Any, int]:
        """A ready placement group of as many nodes as fit within the range (trying
        `at_least` first: the size a growing gang saw room for, while its own bundles are
        still being released)."""
        from ray.util.placement_group import placement_group, remove_placement_group

        low, high = self.plan.min_nodes or self.plan.nnodes, self.plan.nnodes
        fit = self._nodes_that_fit(exclude)
        timeout = _placement_timeout()
        sizes = list(range(min(high, max(fit, low, at_least)), low - 1, -1))
        for size in sizes:
            pg = placement_group([dict(self.bundle) for _ in range(size)], strategy="STRICT_SPREAD")
            wait = timeout if size == low else min(RANGE_STEP_TIMEOUT_S, timeout)
            ready, _ = self.ray.wait([pg.ready()], timeout=wait)
            if ready:
                return pg, size
            remove_placement_group(pg)
        raise LaunchError(
            f"the Ray cluster at {self.address or 'the connected address'} could not reserve "
            f"nnodes={self.options.nnodes} node(s) of {self.bundle} each on distinct Ray nodes "
            f"within {timeout:.0f}s ({self._nodes_that_fit(exclude, free_now=False)} node(s) "
            f"have room for one, {fit} of them free when asked; "
            f"{PLACEMENT_TIMEOUT_ENV} sets the wait)"
        )

    # -- one gang ------------------------------------------------------------------------
    def _start_gang(self, pg: Any, size: int, shipment: Shipment) -> list[_Node]:
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
        host = infos[0]["ip"]
        port = ray.get(actors[0].free_port.remote(host), timeout=60)
        run_id = uuid.uuid4().hex
        node_options = dataclasses.replace(
            self.options,
            gpus=self.plan.nproc_per_node * size,
            gpu_type=self.options.gpu_type,
            nnodes=size,
        )
        env = _forwarded_env(self.options)
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
        return nodes

    def _poll(self, nodes: list[_Node]) -> None:
        ray = self.ray
        live = [n for n in nodes if n.lost is None and n.outcome is None]
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
                self._emit(rank, line)
            if outcome is not None:
                n.outcome = outcome

    def _stop(self, nodes: list[_Node], grace: float) -> None:
        """Ask every node to stop (final checkpoint), wait up to `grace`, then kill them."""
        for n in nodes:
            if n.lost is None and n.outcome is None:
                with contextlib.suppress(Exception):
                    n.actor.stop.remote()
        deadline = time.monotonic() + grace
        try:
            while time.monotonic() < deadline and any(
                n.lost is None and n.outcome is None for n in nodes
            ):
                self._poll(nodes)
        except KeyboardInterrupt:
            pass  # asked twice: stop waiting

    def _kill(self, nodes: list[_Node]) -> None:
        for n in nodes:
            with contextlib.suppress(Exception):
                self.ray.kill(n.actor, no_restart=True)

    def _may_grow(self, nodes: list[_Node]) -> bool:
        """An elastic range below its largest size, with restarts allowed (the function
        continues from its checkpoints), grows when the cluster has room for another node."""
        low, high = self.plan.min_nodes or self.plan.nnodes, self.plan.nnodes
        return low < high and len(nodes) < high and self.options.max_restarts > 0

    def _run_gang(self, nodes: list[_Node], lost: set[str]) -> LaunchResult:
        failed_at: float | None = None
        user_stop = self.options.stop_file
        next_grow_check = time.monotonic() + GROW_CHECK_S
        while True:
            self._poll(nodes)
            if all(n.outcome is not None and n.outcome[0] == "ok" for n in nodes):
                return self._gather(nodes)
            now = time.monotonic()
            if failed_at is None and now >= next_grow_check and self._may_grow(nodes):
                next_grow_check = now + GROW_CHECK_S
                if self._nodes_that_fit(lost) > 0:
                    # Stop as for a preemption (a final checkpoint), then re-form larger.
                    self._stop(nodes, self.options.stop_grace + 5)
                    if all(n.outcome is not None and n.outcome[0] == "ok" for n in nodes):
                        return self._gather(nodes)  # it finished meanwhile
                    raise _Grow(f"a node joined: growing from {len(nodes)} node(s)")
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
                raise self._failure(nodes)
            if user_stop and os.path.exists(user_stop):
                self._stop(nodes, self.options.stop_grace + 5)
                raise StopRequested(
                    f"stopped on request ({user_stop} appeared); the ranks checkpointed at the "
                    "step they reached",
                )

    def _failure(self, nodes: list[_Node]) -> LaunchError:
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
                f"{first.name()} was lost: {first.lost}.{others}\n"
                "The other nodes' ranks were stopped."
            )

        node, exc = sorted(errors, key=lambda item: failure_rank(item[1]))[0]
        if isinstance(exc, LaunchError):
            exc.args = (f"on {node.name()}: {exc.args[0] if exc.args else exc}", *exc.args[1:])
            return exc
        return LaunchError(f"on {node.name()}: {exc!r}")

    def _gather(self, nodes: list[_Node]) -> LaunchResult:
        values: dict[int, Any] = {}
        log_files: dict[int, Path] = {}
        for n in nodes:
            assert n.outcome is not None
            _, ranks, blob, run_dir = n.outcome
            for rank, value in zip(ranks, cloudpickle.loads(blob), strict=True):
                values[rank] = value
                log_files[rank] = Path(run_dir) / "logs" / f"rank_{rank}.log"
        world = self.plan.nproc_per_node * len(nodes)
        missing = sorted(set(range(world)) - set(values))
        if missing:
            raise LaunchError(f"ranks without a result after every node finished: {missing}")
        plan = dataclasses.replace(self.plan, nnodes=len(nodes))
        first = nodes[0].outcome
        assert first is not None
        return LaunchResult(
            [values[r] for r in sorted(values)],
            Path(first[3]),
            log_files,
            plan,
            sorted(values),
        )

    # -- the whole launch ----------------------------------------------------------------
    def run(self, shipment: Shipment) -> LaunchResult:
        from ray.util.placement_group import remove_placement_group

        self._connect()
        restarts_left = self.options.max_restarts
        attempt = 0
        lost: set[str] = set()  # Ray nodes lost by earlier attempts: not counted on again
        grow_to = 0
        while True:
            pg, size = self._place(lost, grow_to)
            grow_to = 0
            nodes: list[_Node] = []
            try:
                nodes = self._start_gang(pg, size, shipment)
                return self._run_gang(nodes, lost)
            except _Grow as grow:
                grow_to = size + 1
                logger.warning("%s; re-forming the nodes", grow)
                if self.user_sink is None:
                    print(f"[trainflow] {grow}; re-forming the nodes", flush=True)
            except LaunchError as exc:
                if restarts_left <= 0 or not (isinstance(exc, NodeLostError) or is_transient(exc)):
                    raise
                restarts_left -= 1
                attempt += 1
                logger.warning(
                    "attempt %d failed (%s); re-forming the nodes (%d restart(s) left)",
                    attempt,
                    first_line(str(exc)),
                    restarts_left,
                )
                if self.user_sink is None:
                    print(f"[trainflow] re-forming the nodes after: {first_line(str(exc))}")
            except BaseException:
                if nodes:
                    self._stop(nodes, self.options.stop_grace)
                raise
            finally:
                lost |= {n.info["node_id"] for n in nodes if n.lost}
                self._kill(nodes)
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)


def launch(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    *,
    options: LaunchOptions,
    on_line: LineSink | None = None,
) -> LaunchResult:
    """Run `fn(*args, **kwargs)` on every rank of a gang of Ray nodes (see the module doc)."""
    shipment = ship(fn, args, kwargs)
    return RayLaunch(options, on_line).run(shipment)
