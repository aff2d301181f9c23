"""The one module of `trainflow` that imports Prefect: rank output into Prefect run logs, a
launch as its own task run, and the backend of `remote=True` calls, run on a deployment (and
cancelled there when their caller stops: docs/cancellation.md).

It imports no launch backend: `trainflow.launch.backends` hands it the launch to run. The
backends only import it when Prefect is already loaded (or a remote call is asked for), so
the library and every rank stay free of Prefect.
"""

import base64
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from uuid import UUID

import cloudpickle
from prefect import get_client, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.actions import ArtifactCreate
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp
from prefect.client.schemas.sorting import LogSort
from prefect.context import FlowRunContext, TaskRunContext
from prefect.deployments import run_deployment
from prefect.logging.loggers import PrefectLogAdapter, get_logger
from prefect.states import Cancelled, Cancelling

from trainflow.errors import LaunchError
from trainflow.launch.plan import cluster_plan
from trainflow.launch.ship import Shipment, remote_payload
from trainflow.launch.spec import LaunchOptions, LaunchResult, LineSink, rank_label

# A launch to run with the line sink given: what the backends hand to this module.
Launch = Callable[[LineSink], LaunchResult]


def in_prefect_run() -> bool:
    """True inside a Prefect flow run or task run."""
    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def _pipeline_flow_run_id() -> UUID | None:
    """The outermost flow run above this one: the pipeline a person started.

    Technique subflows launch the ranks; their lines and the rank-logs artifact belong to the
    pipeline's run, where people look for them.
    """
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return None
    run = context.flow_run
    if run.parent_task_run_id is None:
        return run.id
    with get_client(sync_client=True) as client:
        while run.parent_task_run_id is not None:
            parent_task = client.read_task_run(run.parent_task_run_id)
            if parent_task.flow_run_id is None:
                break
            run = client.read_flow_run(parent_task.flow_run_id)
    return run.id


def in_task_run() -> bool:
    return TaskRunContext.get() is not None


def launch_logged(name: str, options: LaunchOptions, launch: Launch) -> LaunchResult:
    """Run `launch` from inside a Prefect run, forwarding each rank line to the pipeline run's
    logs, and record where the rank logs are as an artifact of that run."""
    run_logger = get_run_logger()
    pipeline_run_id = _pipeline_flow_run_id()
    extra = dict(getattr(run_logger, "extra", None) or {})
    if pipeline_run_id is not None:
        extra["flow_run_id"] = str(pipeline_run_id)
    logger = PrefectLogAdapter(get_logger("prefect.task_runs"), extra=extra)
    result = launch(lambda r, line: logger.info("%s %s", rank_label(r, options), line))
    if result.run_dir is None:  # the ranks ran elsewhere, and logged there
        return result
    files = "\n".join(f"| {r} | `{p}` |" for r, p in result.log_files.items())
    logger.info("Full rank logs: %s", result.run_dir / "logs")
    task_context = TaskRunContext.get()
    with get_client(sync_client=True) as client:
        client.create_artifact(
            ArtifactCreate(
                key="rank-logs",
                type="markdown",
                data=(
                    f"### Rank logs of `{name}`\n\n"
                    f"{result.resources.world_size} ranks on {result.resources.device}\n\n"
                    f"| rank | log file |\n|---|---|\n{files}\n"
                ),
                description="Where each rank's full stdout/stderr is kept",
                flow_run_id=pipeline_run_id,
                task_run_id=task_context.task_run.id if task_context else None,
            )
        )
    return result


def as_task_run(name: str, options: LaunchOptions, launch: Launch) -> LaunchResult:
    """Run `launch` as a task run of its own in the current flow run, logged there."""
    as_task = task(
        name=f"{name}.distributed",
        task_run_name=f"{name}.distributed[{options.gpus}]",
        cache_policy=NO_CACHE,
        persist_result=False,
    )(launch_logged)
    return as_task(name, options, launch)


class RemoteDeployment:
    """The backend of `remote=True`: the call runs on a deployment of
    `flows/remote.py:remote_call`, whose workers have the GPUs."""

    def __init__(self, deployment: str, options: LaunchOptions):
        self.deployment = deployment
        self.options = options

    def run(self, shipment: Shipment) -> LaunchResult:
        options = self.options
        # With the caller's sources, so that tracebacks from the ranks there show its files.
        values = run_remote(self.deployment, remote_payload(shipment), options, shipment.name)
        plan = cluster_plan(options.gpus, options.gpu_type, options.nnodes, self.deployment)
        return LaunchResult(values, None, {}, plan, list(range(len(values))))


def run_remote(
    deployment: str,
    payload: bytes,
    options: LaunchOptions,
    name: str = "fn",
    say: Callable[[str], None] | None = None,
) -> list[Any]:
    """Run a pickled call on a deployment of `flows/remote.py:remote_call`; its rank values.

    Waits for the flow run, saying how it goes (`say`, stderr by default): queued for a
    worker, starting, running, and the run's log lines (the ranks' output among them). Its
    result (the per-rank values, pickled) comes back through the deployment's result storage,
    which must be one this process can read too.
    """
    settings = {**dataclasses.asdict(options), "remote": False}
    flow_run: Any = run_deployment(
        deployment,
        parameters={"payload": base64.b64encode(payload).decode(), "options": settings},
        timeout=0,  # submitted only: `follow_flow_run` waits, and says what happens
    )
    what = f"{name}.distributed() on {deployment!r}"
    with _cancelled_when_stopped(flow_run.id, what, say or _stderr):
        flow_run = follow_flow_run(flow_run.id, what, say)
    state = flow_run.state
    if state is not None and state.is_failed():
        try:
            state.result()  # the run's own exception (a RankError, ...), where it was kept
        except LaunchError:
            raise
        except Exception:  # noqa: BLE001 - not kept: the state's message says what happened
            pass
    if state is None or not state.is_completed():
        raise LaunchError(
            f"the remote call on deployment {deployment!r} (flow run {flow_run.name}, "
            f"{flow_run.id}) ended {state.name if state else 'without a state'}: "
            f"{state.message if state else ''}"
        )
    return cloudpickle.loads(base64.b64decode(state.result()))


class _CallerTerminated(BaseException):
    """SIGTERM reached a caller that had no handler of its own (it would have died at once)."""


@contextlib.contextmanager
def _cancelled_when_stopped(
    flow_run_id: UUID, what: str, say: Callable[[str], None]
) -> Iterator[None]:
    """Cancel flow run `flow_run_id` if the caller stops while it waits for it.

    Ctrl-C, an exception, and SIGTERM: a flow run's (Prefect raises `TerminationSignal`, as
    when the caller's own flow run is cancelled), or a plain process's, whose default action
    would kill it before it could cancel anything; there SIGTERM is handled during the wait,
    and once the run is cancelled the process dies of it as it would have.
    """
    handled = threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    )
    if handled:
        signal.signal(signal.SIGTERM, _raise_caller_terminated)
    try:
        yield
    except BaseException as exc:
        why = "SIGTERM" if isinstance(exc, _CallerTerminated) else type(exc).__name__
        try:
            cancel_flow_run(flow_run_id, f"Its caller stopped ({why}).")
            say(f"[trainflow] {what}: stopped ({why}); flow run {flow_run_id} cancelled")
        except Exception as error:  # noqa: BLE001 - the stop, not this, is what to raise
            say(
                f"[trainflow] {what}: stopped ({why}); cancelling flow run {flow_run_id} "
                f"failed ({error}): cancel it in the UI or with `prefect flow-run cancel`"
            )
        if isinstance(exc, _CallerTerminated):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        if handled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _raise_caller_terminated(signum: int, frame: Any) -> None:
    raise _CallerTerminated(signum)


def cancel_flow_run(flow_run_id: UUID, message: str) -> None:
    """Cancel flow run `flow_run_id` unless it has ended: Cancelling when a worker may run it
    (the worker kills its process, then marks it Cancelled), Cancelled while it waits for one.
    """
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
        if state is not None and state.is_final():
            return
        if state is None or state.is_scheduled():
            client.set_flow_run_state(flow_run_id, Cancelled(message=message), force=True)
        else:
            client.set_flow_run_state(flow_run_id, Cancelling(message=message), force=True)


# How often a remote call's flow run is read while the caller waits for it.
REMOTE_POLL_S = 1.0
# Log lines read at a time (the most the server gives).
REMOTE_LOG_PAGE = 200


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def describe_state(flow_run: Any) -> str:
    """What a flow run's state means to the caller waiting for it."""
    state = flow_run.state
    if state is None:
        return "submitted"
    kind = state.type.value
    if kind == "SCHEDULED":
        pool = f" of work pool {flow_run.work_pool_name!r}" if flow_run.work_pool_name else ""
        return f"queued: waiting for a worker{pool} to pick it up ({state.name})"
    if kind == "PENDING":
        return "starting: a worker picked it up and is starting the run"
    if kind == "RUNNING":
        return "running: the ranks start on the worker's machine"
    return f"ended {state.name}" + (f": {state.message}" if state.message else "")


def follow_flow_run(flow_run_id: UUID, what: str, say: Callable[[str], None] | None = None) -> Any:
    """Wait until flow run `flow_run_id` ends, saying (`say`, stderr by default) each change of
    its state and each line it logs (the ranks' lines, `[rank N] ...`); the ended flow run."""
    say = say or _stderr
    seen_logs: set[UUID] = set()
    last: str | None = None
    after = None
    with get_client(sync_client=True) as client:
        while True:
            flow_run = client.read_flow_run(flow_run_id)
            status = describe_state(flow_run)
            if status != last:
                say(f"[trainflow] {what}: flow run {flow_run.name} {status}")
                last = status
            logs = client.read_logs(
                log_filter=LogFilter(
                    flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]),
                    timestamp=LogFilterTimestamp(after_=after),
                ),
                sort=LogSort.TIMESTAMP_ASC,
                limit=REMOTE_LOG_PAGE,
            )
            # `after_` includes its own timestamp: the last line read comes again.
            new = [log for log in logs if log.id not in seen_logs]
            for log in new:
                seen_logs.add(log.id)
                say(f"[remote] {log.message}")
                after = log.timestamp
            if flow_run.state is not None and flow_run.state.is_final() and not new:
                return flow_run
            if len(new) < REMOTE_LOG_PAGE:  # else more lines wait: read them at once
                time.sleep(REMOTE_POLL_S)


__all__ = [
    "cancel_flow_run",
    "describe_state",
    "follow_flow_run",
    "RemoteDeployment",
    "as_task_run",
    "in_prefect_run",
    "in_task_run",
    "launch_logged",
    "run_remote",
]
