"""Cancellation reaches everything a run started, on a real server with a real process worker.

prefect.yaml's deployments go to the session's Prefect server; `prefect worker start
--run-once` runs what is scheduled, as an operator's worker would. Each test stops a run the
way a person or the infrastructure does (Cancel in the UI or API, a caller stopped, a machine
gone) and checks what is left: every flow run's state, every process, every MLflow run.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterId,
    FlowRunFilterParentFlowRunId,
    TaskRunFilter,
    TaskRunFilterName,
)
from prefect.states import Cancelling

from tests import processes
from tests.conftest import REPO_ROOT, prefect_server, run_once_worker
from trainflow import tracking

pytestmark = pytest.mark.slow

# Hours of steps at this size: every stop lands mid-training.
LONG_MLP = {
    "gpus": 2,
    "gpu_type": "cpu",
    "num_epochs": 5000,
    "registered_model_name": "mlp-cancelled",
}
# Two trials in flight under a 2-rank budget: one trains, the other waits for the ranks.
SWEEP = {
    "pipeline": "mlp",
    "space": {"hidden_size": [32, 64]},
    "base": LONG_MLP,
    "trials": 2,
    "sampler": "grid",
    "budget": 2,
    "parallel": 2,
    "pool": "cancel-test-ranks",
}


def _cli(*args: str, env: dict) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture
def deployed(tmp_path) -> Iterator[str]:
    """sweep/cpu-local, mlp/cpu-local and remote-call/cpu-local, deployed from prefect.yaml to
    a Prefect server of the test's own: the session's server is shared with other tests that
    overwrite the same pool and deploy the same names meanwhile (a remote call's run then waited
    on a queue the overwrite replaced)."""
    home = tmp_path / "prefect-home"
    home.mkdir()
    with prefect_server(home) as url:
        yield _deploy(url)


def _deploy(url: str) -> str:
    env = dict(os.environ)
    _cli("work-pool", "create", "cpu-local", "--type", "process", "--overwrite", env=env)
    _cli(
        "--no-prompt",
        "deploy",
        "--name",
        "sweep/cpu-local",
        "--name",
        "mlp/cpu-local",
        "--name",
        "remote-call/cpu-local",
        env=env,
    )
    return url


@contextlib.contextmanager
def _worker(log: Path, env: dict | None = None):
    """A process worker on cpu-local that runs what is scheduled now, then exits; stopped
    (its whole session) if it is still there at the end."""
    with open(log, "wb") as out:
        worker = run_once_worker({**os.environ, **(env or {})}, out)
    try:
        yield worker
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()


def _descendants(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def _wait_for(what: str, check: Callable[[], Any], timeout_s: float, log: Path) -> Any:
    """`check()`'s first true value, polled until `timeout_s`; fails naming `what` with the
    worker's log."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            pytest.fail(
                f"{what} after {timeout_s:.0f} s:\n{log.read_text(errors='replace')[-4000:]}"
            )
        time.sleep(0.5)
    return value


def _training() -> bool:
    """Some rank 0 has recorded a training step (its progress file)."""
    return any(Path(os.environ["TRAINFLOW_HOME"]).glob("outputs/*/*/progress.json"))


def _mlflow_runs(experiment: str) -> list:
    client = tracking.store_client()
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found is not None else []


def _final(client, flow_run_id: UUID, timeout_s: float, log: Path):
    return _wait_for(
        f"flow run {flow_run_id} not final",
        lambda: (run := client.read_flow_run(flow_run_id)).state.is_final() and run,
        timeout_s,
        log,
    )


def _flow_runs_under(client, parents: list[UUID]) -> list:
    """Every flow run below `parents` (subflow runs, theirs, ...)."""
    found: list = []
    while parents:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=parents)
            )
        )
        found += runs
        parents = [r.id for r in runs]
    return found


def test_cancelling_a_sweep_cancels_its_trials_and_leaves_nothing_running(deployed, tmp_path):
    log = tmp_path / "worker.log"
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("sweep/cpu-local")
        sweep = client.create_flow_run_from_deployment(deployment.id, parameters={"config": SWEEP})

        def trials() -> list:
            return client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[sweep.id])
                )
            )

        procs: list[psutil.Process] = []
        with _worker(log) as worker:
            try:
                _wait_for("no trial trains", _training, 240, log)
                running = _wait_for(
                    "not both trials running",
                    lambda: len(r := [t for t in trials() if t.state.is_running()]) == 2 and r,
                    60,
                    log,
                )
                procs = _descendants(worker.pid)
                commands = [" ".join(p.cmdline()) for p in procs]
                assert any("trainflow.launch.agent" in c for c in commands), commands
                client.set_flow_run_state(sweep.id, Cancelling())  # the UI's Cancel button
                cancelled_at = time.monotonic()
                ended = _final(client, sweep.id, 90, log)
                took = time.monotonic() - cancelled_at
                survivors = processes.survivors(procs, 15)
                # Read at once: the sweep ends its trials before it ends (the server's own
                # clean-up of a cancelled run's subflow runs comes up to 20 s later).
                ended_trials = trials()
                below = _flow_runs_under(client, [t.id for t in ended_trials])
                trial_tasks = client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[sweep.id])),
                    task_run_filter=TaskRunFilter(
                        name=TaskRunFilterName(any_=[t.name for t in ended_trials])
                    ),
                )
            finally:
                processes.kill_all(procs)
    text = log.read_text(errors="replace")[-4000:]
    assert ended.state.is_cancelled(), f"{ended.state.name}: {text}"
    assert survivors == [], [(p.pid, p.cmdline()) for p in survivors]
    assert {t.id for t in running} == {t.id for t in ended_trials}
    states = {t.name: t.state.name for t in ended_trials}
    assert all(t.state.is_cancelled() for t in ended_trials), (states, text)
    assert "The sweep was stopped" in ended_trials[0].state.message
    assert len(trial_tasks) == 2 and all(t.state.is_cancelled() for t in trial_tasks)
    assert below and all(r.state.is_final() for r in below), [(r.name, r.state) for r in below]
    runs = {r.info.run_name: r.info.status for r in _mlflow_runs("mlp")}
    assert runs and set(runs.values()) == {"KILLED"}, runs
    print(f"sweep cancelled in {took:.1f} s; trials {states}; MLflow {runs}")


# A notebook cell whose ranks never end on their own: only a cancel stops them.
FOREVER = """
import time
from trainflow import distributed

@distributed(gpus=2, gpu_type="cpu", remote=True)
def forever():
    while True:
        time.sleep(0.2)
"""
CALL = FOREVER + "\nforever.distributed()\n"
# The same call made by a flow run, as a pipeline would: Prefect handles its SIGTERM.
CALL_IN_FLOW = (
    FOREVER
    + """
from prefect import flow

@flow
def caller():
    forever.distributed()

caller()
"""
)


def _rank_processes(pid: int) -> list[psutil.Process]:
    """The launch agent and ranks under process `pid` (all run `trainflow.launch.agent`)."""
    return [p for p in _descendants(pid) if "trainflow.launch.agent" in " ".join(p.cmdline())]


@pytest.mark.parametrize(
    ("cell", "sig", "why"),
    [
        (CALL, signal.SIGINT, "KeyboardInterrupt"),
        (CALL, signal.SIGTERM, "SIGTERM"),
        (CALL_IN_FLOW, signal.SIGTERM, "TerminationSignal"),
    ],
    ids=["ctrl-c", "sigterm", "sigterm-to-a-flow-run"],
)
def test_stopping_a_remote_caller_cancels_the_remote_flow_run(deployed, tmp_path, cell, sig, why):
    """Ctrl-C in a notebook or script (SIGINT to its group), SIGTERM (`timeout`, systemd), or
    SIGTERM to a flow run making the call (what a worker sends when that run is cancelled):
    the `remote=True` call's flow run ends Cancelled and its ranks on the worker end."""
    env = {**os.environ, "TRAINFLOW_REMOTE_DEPLOYMENT": "remote-call/cpu-local"}
    out, log = tmp_path / "caller.txt", tmp_path / "worker.log"
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("remote-call/cpu-local")

        def remote_runs() -> list:
            return client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    deployment_id=FlowRunFilterDeploymentId(any_=[deployment.id])
                )
            )

        before = {r.id for r in remote_runs()}
        with open(out, "wb") as f:
            caller = subprocess.Popen(
                [sys.executable, "-c", cell],
                cwd=tmp_path,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's foreground job
            )
        procs: list[psutil.Process] = []
        try:
            (run,) = _wait_for(
                "the remote call created no flow run",
                lambda: [r for r in remote_runs() if r.id not in before],
                120,
                out,
            )
            with _worker(log) as worker:
                ranks = _wait_for(
                    "no ranks on the worker",
                    lambda: len(_rank_processes(worker.pid)) >= 3,
                    180,
                    log,
                )
                procs = _descendants(worker.pid)
                assert ranks and caller.poll() is None, out.read_text()[-3000:]
                os.killpg(caller.pid, sig)
                stopped_at = time.monotonic()
                caller.wait(timeout=30)
                ended = _final(client, run.id, 60, log)
                took = time.monotonic() - stopped_at
                survivors = processes.survivors(procs, 15)
                history = client.read_flow_run_states(run.id)
        finally:
            if caller.poll() is None:
                os.killpg(caller.pid, signal.SIGKILL)
                caller.wait()
            processes.kill_all(procs)
    text = out.read_text(errors="replace")
    assert caller.returncode == -sig, text[-3000:]  # it still dies of the signal
    assert ended.state.is_cancelled(), (ended.state.name, log.read_text()[-3000:])
    assert f"stopped ({why}); flow run {run.id} cancelled" in text, text[-3000:]
    assert f"Its caller stopped ({why})." in [s.message for s in history], history
    assert survivors == [], [(p.pid, p.cmdline()) for p in survivors]
    print(f"{sig.name}: remote flow run {ended.state.name} {took:.1f} s after the caller's stop")


# The shortest heartbeat Prefect allows, and one missed beat (plus the automation's grace).
HEARTBEAT_S = 30


@pytest.fixture
def crash_silent_runs(deployed):
    """The automation of `python -m deployments.automations`, for a 30 s heartbeat; removed
    after the test (it is server-wide: other tests' runs beat at Prefect's default 180 s)."""
    from prefect.automations import Automation

    from deployments.automations import CRASH_SILENT_RUNS

    for args in ([], ["--missed", "1"]):  # made, then updated in place
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "deployments.automations",
                "--heartbeat-s",
                str(HEARTBEAT_S),
                *args,
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    with get_client(sync_client=True) as client:
        assert len(client.read_automations_by_name(CRASH_SILENT_RUNS)) == 1
    automation = Automation.read(name=CRASH_SILENT_RUNS)
    assert automation.trigger.within.total_seconds() == HEARTBEAT_S + 15
    try:
        yield automation
    finally:
        automation.delete()


def test_a_run_whose_machine_died_ends_crashed_by_its_missing_heartbeat(
    crash_silent_runs, tmp_path
):
    """SIGKILL to the worker and the flow run's process at once (an evicted pod, a machine
    gone): nothing reports, and without the automation the run would stay Running for good.
    Before the kill, the run stays Running past the automation's window: its heartbeats count."""
    window = crash_silent_runs.trigger.within.total_seconds()
    log = tmp_path / "worker.log"
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("mlp/cpu-local")
        run = client.create_flow_run_from_deployment(deployment.id, parameters={"config": LONG_MLP})
        procs: list[psutil.Process] = []
        env = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)}
        with _worker(log, env) as worker:
            try:
                _wait_for(
                    "not running", lambda: client.read_flow_run(run.id).state.is_running(), 120, log
                )
                running_since = time.monotonic()
                _wait_for("no training step", _training, 240, log)
                # A live run outlasts the window: only its heartbeats keep it Running.
                while time.monotonic() - running_since < window + 10:
                    assert client.read_flow_run(run.id).state.is_running(), log.read_text()[-3000:]
                    time.sleep(1)
                procs = _descendants(worker.pid)
                flow_process = psutil.Process(worker.pid).children()
                processes.kill_all([psutil.Process(worker.pid), *flow_process])
                killed_at = time.monotonic()
                ended = _final(client, run.id, window + 45, log)
                took = time.monotonic() - killed_at
                survivors = processes.survivors(procs, 15)
            finally:
                processes.kill_all(procs)
    assert ended.state.is_crashed(), ended.state
    assert ended.state.message.startswith(f"No heartbeat for {window:.0f} s"), ended.state
    assert took <= window + 45, took
    assert survivors == [], [(p.pid, p.cmdline()) for p in survivors]
    (mlflow_run,) = _mlflow_runs("mlp")
    assert mlflow_run.info.status == "RUNNING"  # nobody was left to end it: see test_stale_runs
    print(f"Crashed {took:.1f} s after the kill (window {window:.0f} s)")
