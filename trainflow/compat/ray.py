"""Patches into Ray: the free resources of each node, which Ray's public API gives only for
the whole cluster.

Written and tested for Ray 2.60.
"""

from typing import Any

from trainflow.compat.patching import check, declare, relies_on

RAY = ">=2.40,<2.61"

AVAILABLE_PER_NODE = declare(
    "ray: _private.state.available_resources_per_node",
    "ray",
    RAY,
    target="ray._private.state:available_resources_per_node",
    why="an elastic gang grows only onto nodes with room free now; without it the launch "
    "counts what the nodes have (it may then wait for placement)",
    public_api="ray.available_resources() is cluster-wide, not per node",
)


def available_resources_per_node() -> dict[str, dict[str, Any]] | None:
    """{node id: {resource: amount free}}, or None when this Ray cannot say."""
    if relies_on(AVAILABLE_PER_NODE):
        return None
    check(AVAILABLE_PER_NODE)
    from ray._private import state

    free: dict[str, dict[str, Any]] = state.available_resources_per_node()
    return free
