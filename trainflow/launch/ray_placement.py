"""Multi-node launches placed by a Ray cluster, with the local launcher's code on every node.

`@distributed(gpus=16, nnodes=2)` with `RAY_ADDRESS` set (or `ray_address=` given) runs here:

1. **Gang scheduling.** One placement group with a bundle per node (its GPUs, or one CPU per
   CPU rank), strategy `STRICT_SPREAD`: every node is reserved before any rank starts, each on
   a different Ray node. Placement is by Ray node, not by IP, so two Ray nodes behind one
   address still get distinct node ranks.
2. **One elastic agent per node.** A small Ray actor in each bundle runs the same supervised
   launch as a single-machine call (`trainflow.launch.local`): torch's elastic agent in its own
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

import contextlib
import functools
import logging
import os
from typing import Any

from trainflow.compat.ray import available_resources_per_node
from trainflow.errors import (
    LaunchConfigError,
    LaunchError,
    first_line,
    is_transient,
)
from trainflow.launch.plan import LaunchPlan, cluster_plan, ray_cluster_address
from trainflow.launch.ray_gang import Gang, Grow, NodeLostError
from trainflow.launch.ship import Shipment
from trainflow.launch.spec import LaunchOptions, LaunchResult, LineSink, rank_label

logger = logging.getLogger(__name__)

# Seconds to wait for the cluster to reserve every node of a gang (an autoscaler may be adding
# nodes); past it the launch fails, naming what was asked and what the cluster has.
PLACEMENT_TIMEOUT_ENV = "TRAINFLOW_RAY_PLACEMENT_TIMEOUT"
DEFAULT_PLACEMENT_TIMEOUT_S = 300.0
# With an elastic range, how long to try a larger gang before settling for fewer nodes.
RANGE_STEP_TIMEOUT_S = 10.0


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
    """A launch on a Ray cluster: place a gang, run a node launch in each bundle (`Gang`),
    re-form it after a lost node or to grow within an elastic range."""

    def __init__(self, options: LaunchOptions, sink: LineSink | None):
        self.options = options
        self.user_sink = sink
        self.address = ray_address(options)
        self.plan = resolve_plan(options)
        self.bundle, self.actor_resources = _bundle(self.plan)
        self.ray = _import_ray()

    def _emit(self, rank: int, line: str) -> None:
        if self.user_sink is None:
            print(f"{rank_label(rank, self.options)} {line}", flush=True)
        else:
            self.user_sink(rank, line)

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
            free = available_resources_per_node() if free_now else None
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

    def _room_for_another(self, lost: set[str]) -> bool:
        return self._nodes_that_fit(lost) > 0

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
            gang = Gang(self.ray, self.options, self.plan, self.actor_resources, self._emit)
            try:
                gang.start(pg, size, shipment)
                return gang.run(functools.partial(self._room_for_another, lost))
            except Grow as grow:
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
                if gang.nodes:
                    gang.stop(self.options.stop_grace)
                raise
            finally:
                lost |= {n.info["node_id"] for n in gang.nodes if n.lost}
                gang.kill()
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
