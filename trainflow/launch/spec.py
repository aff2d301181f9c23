"""What a launch is, as data: the caller's options, the spec shipped to the agent, the result.

`LaunchOptions` are the decorator's arguments, validated where they are given. `LaunchSpec` is
what the caller writes into the launch folder for the agent and its ranks, on this interpreter
or another one: typed, checked when it is made and again when it is read, and versioned, so an
agent that does not understand a spec refuses it naming the field instead of failing later on
a missing key. `LaunchResult` is what a launch returns.

This is the bottom of the launch layer: it imports nothing of trainflow but the plan, errors
and paths.
"""

import json
import math
import os
import types
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from trainflow.errors import LaunchConfigError
from trainflow.launch.plan import LaunchPlan, node_range

LineSink = Callable[[int, str], None]

RDZV_ENDPOINT_ENV = "TRAINFLOW_RDZV_ENDPOINT"
RUN_ID_ENV = "TRAINFLOW_RUN_ID"
STANDBY_ENV = "TRAINFLOW_STANDBY"
START_METHOD_ENV = "TRAINFLOW_START_METHOD"
REMOTE_DEPLOYMENT_ENV = "TRAINFLOW_REMOTE_DEPLOYMENT"
# The agent's pid, which each rank checks to exit with it (see `worker`).
AGENT_PID_ENV = "TRAINFLOW_AGENT_PID"
# Set on every rank: its launch's run folder (`trainflow.runtime` reads it).
RUN_DIR_ENV = "TRAINFLOW_RUN_DIR"
# SIGTERM-to-SIGKILL grace of a launch's final sweep, once the launch is decided.
SHUTDOWN_GRACE_S = 3.0


def _check_seconds(name: str, value: object, zero_ok: bool = False) -> None:
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value >= 0 if zero_ok else value > 0)
    )
    if not ok:
        kind = "a number of seconds >= 0" if zero_ok else "a positive number of seconds"
        raise ValueError(f"{name} must be {kind}, got {value!r}")


def check_interpreter_path(python: object) -> None:
    if not isinstance(python, str) or not python:
        raise ValueError(f"python must be the path of a Python interpreter, got {python!r}")
    path = Path(python)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ValueError(
            f"python={python!r}: no executable interpreter there (a framework's environment "
            "is made by `bash scripts/setup-framework.sh NAME`)"
        )


@dataclass(frozen=True)
class LaunchOptions:
    """How to launch: the decorator's arguments, validated."""

    gpus: int
    gpu_type: str | None = None
    nnodes: int | str = 1
    timeout: float | None = None
    init_process_group: bool = False
    max_restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    collective_timeout: float = 600.0
    hang_timeout: float | None = None
    stop_grace: float = 30.0
    stop_file: str | None = None
    remote: bool = False
    ray_address: str | None = None
    python: str | None = None

    def __post_init__(self) -> None:
        node_range(self.nnodes)
        if self.python is not None:
            check_interpreter_path(self.python)
        if self.timeout is not None:
            _check_seconds("timeout", self.timeout)
        _check_seconds("collective_timeout", self.collective_timeout)
        if self.hang_timeout is not None:
            _check_seconds("hang_timeout", self.hang_timeout)
        _check_seconds("stop_grace", self.stop_grace, zero_ok=True)
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        for key, value in self.env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"env must map str to str; {key!r} -> {value!r} does not")


@dataclass(frozen=True)
class LaunchResult:
    """Per-rank return values (ordered by global rank) and where the rank logs are."""

    values: list[Any]
    # None when the ranks ran elsewhere (`remote=True`): their logs are the remote run's.
    run_dir: Path | None
    log_files: dict[int, Path]
    resources: LaunchPlan
    # The global rank of each value (this node's ranks when each node launches its own).
    ranks: list[int] = field(default_factory=list)


def rank_label(rank: int, options: "LaunchOptions") -> str:
    """`[rank N]`, or `[node K rank N]` when the launch spans several nodes."""
    low, high = node_range(options.nnodes)
    if high == 1:
        return f"[rank {rank}]"
    return f"[node {rank // max(1, options.gpus // high)} rank {rank}]"


# Bumped whenever a field of `LaunchSpec` is added, removed, renamed or changes meaning: an
# agent refuses a spec of another version rather than misread it.
SPEC_VERSION = 1


class LaunchSpecError(LaunchConfigError):
    """A launch spec that this agent cannot run: another version, a field missing, unknown or
    of the wrong type. Names the field."""


@dataclass(frozen=True)
class LaunchSpec:
    """What the caller ships to the agent and ranks of one launch (`spec.json` in its folder).

    Values only, no secrets: the environment's values travel in the agent's environment and
    only their names are recorded here.
    """

    function: str
    run_id: str
    rdzv_endpoint: str
    rdzv_timeout_s: int
    # Whether this node hosts the rendezvous store, when the launcher that placed the nodes
    # says so; None: torch decides from the endpoint.
    rdzv_is_host: bool | None
    nnodes: int
    min_nodes: int
    nproc_per_node: int
    device: str
    max_restarts: int
    # The agent's own SIGTERM-to-SIGKILL grace for the workers, when it is stopped from
    # outside (a node shutdown) rather than by the caller.
    shutdown_timeout_s: float
    collective_timeout_s: float
    hang_timeout_s: float | None
    init_process_group: bool
    start_method: str
    sys_path: list[str]
    python: str
    # `[name, first line, file]` of each code object shipped by value (see `ship`).
    code_files: list[list[Any]]
    env_names: list[str]
    caller_pid: int
    version: int = SPEC_VERSION

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            if not _is_instance(value, hints[f.name]):
                raise LaunchSpecError(
                    f"launch spec field {f.name!r}: expected {hints[f.name]}, got {value!r}"
                )
        if self.version != SPEC_VERSION:
            raise LaunchSpecError(
                f"launch spec version {self.version}, but this trainflow reads version "
                f"{SPEC_VERSION}: the caller and the agent's interpreter run different "
                "trainflow releases"
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "LaunchSpec":
        """Read a spec written by `to_json`, refusing one this release does not understand."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise LaunchSpecError(f"launch spec is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise LaunchSpecError("launch spec must be a JSON object")
        version = data.get("version")
        if version != SPEC_VERSION:
            raise LaunchSpecError(
                f"launch spec version {version!r}, but this trainflow reads version "
                f"{SPEC_VERSION}: the caller and the agent's interpreter run different "
                "trainflow releases"
            )
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        missing = sorted(n for n in names if n not in data and n != "version")
        if unknown or missing:
            raise LaunchSpecError(
                "launch spec fields do not match this trainflow's: "
                + ", ".join(
                    [*(f"unknown field {n!r}" for n in unknown)]
                    + [*(f"missing field {n!r}" for n in missing)]
                )
            )
        return cls(**data)


def _is_instance(value: object, hint: Any) -> bool:
    """`isinstance` for the field types `LaunchSpec` uses (unions, lists, bool apart from int)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_instance(value, h) for h in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_is_instance(v, item) for v in value)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)
