"""Stopping a pipeline from outside: Ctrl-C, SIGTERM, SIGKILL, and a cancel through Prefect.

Real processes and real signals. `python -m flows.mlp` runs in its own session, as a terminal's
foreground job does, with no `PREFECT_API_URL`, so it starts its own temporary Prefect server;
each test waits until rank 0 logs training steps, then stops it the way a person or a
scheduler would and checks what is left: how fast it ended, the MLflow run's status, the
registry, and every process the run had started (server and guard included).
"""

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests import processes
from tests.conftest import REPO_ROOT
from trainflow import tracking
from trainflow.checkpoint import complete_checkpoints

pytestmark = pytest.mark.slow

# Hours of steps at this size: every stop lands mid-training.
LONG = {"num_epochs": 5000, "registered_model_name": "mlp-stopped"}
LONG_SFT = {"max_steps": 100000, "checkpoint_every": 100000, "registered_model_name": "sft-stopped"}
SHM = Path("/dev/shm")

# `python -m deployments.serve mlp/cpu-local`, under a name of its own: the session's server
# may also hold `mlp/cpu-local` deployed from prefect.yaml (code pulled from storage), which a
# served deployment of the same name would half overwrite.
SERVE = """
import sys
from prefect import serve
from deployments.serve import runner_deployments

[deployment] = runner_deployments({"mlp/cpu-local"})
deployment.name = sys.argv[1]
serve(deployment)
"""
SERVED = "cpu-local-cancel-test"


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory) -> Path:
    """One PREFECT_HOME for this module's command lines: its database is created only once."""
    return tmp_path_factory.mktemp("prefect-home-stops")


def _rank_log_has_steps(trainflow_home: Path) -> bool:
    """Rank 0 has recorded a training step (its progress file, any pipeline)."""
    return any(trainflow_home.glob("outputs/*/*/progress.json"))


def _wait_training(
    proc: subprocess.Popen,
    out: Path,
    ended: Callable[[], bool] = lambda: False,
    timeout_s: float = 300,
) -> None:
    """Return once rank 0 has logged a training step; fail (with the output) if it never does
    or the run `ended` first."""
    home = Path(os.environ["TRAINFLOW_HOME"])
    deadline = time.monotonic() + timeout_s
    while not _rank_log_has_steps(home):
        assert proc.poll() is None, f"exited {proc.returncode}:\n{out.read_text()[-4000:]}"
        assert not ended(), f"ended before training:\n{out.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no training step:\n{out.read_text()[-4000:]}"
        time.sleep(0.2)


def _start_pipeline(
    prefect_home: Path, out: Path, pipeline: str = "mlp", options: dict | None = None
) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(prefect_home)
    args = [f"--{k.replace('_', '-')}={v}" for k, v in (options or LONG).items()]
    with open(out, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", f"flows.{pipeline}", *args],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, like a terminal's foreground job
        )


def _run_processes(pid: int) -> list[psutil.Process]:
    """The process and everything it started, checked to include the server and its guard."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    commands = [" ".join(p.cmdline()) for p in procs]
    for needed in ("trainflow.launch.guard", "uvicorn", "trainflow.launch.agent"):
        assert any(needed in c for c in commands), (needed, commands)
    return procs


def _shm_in_use(procs: list[psutil.Process]) -> set[str]:
    """Names of /dev/shm entries the processes hold open or mapped."""
    names = set()
    for proc in procs:
        try:
            paths = [f.path for f in proc.open_files()] + [m.path for m in proc.memory_maps()]
        except psutil.Error:
            continue
        names.update(Path(p).name for p in paths if p.startswith(f"{SHM}/"))
    return names


def _shm_left(before: set[str], in_use: set[str], procs: list[psutil.Process]) -> list[str]:
    """New /dev/shm entries made by the run (held by its processes, or named after one)."""
    pids = {str(p.pid) for p in procs}
    new = set(os.listdir(SHM)) - before
    return sorted(n for n in new if n in in_use or any(pid in n for pid in pids))


def _only_run(experiment: str = "mlp"):
    client = tracking.store_client()
    found = client.get_experiment_by_name(experiment)
    assert found is not None, "no MLflow experiment: the run never started"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, [(r.info.run_id, r.info.status) for r in runs]
    return client, runs[0]


@pytest.mark.parametrize(
    ("sig", "reason", "code"),
    [(signal.SIGINT, "Ctrl-C (SIGINT)", 130), (signal.SIGTERM, "SIGTERM", 143)],
    ids=["ctrl-c", "sigterm-to-group"],
)
# It checks /dev/shm as a whole for what the run left, which other runs change meanwhile:
# seen once with tests in parallel, the run's shared memory still there after its stop.
@pytest.mark.alone
def test_stopping_the_process_group_ends_the_run_killed_within_seconds(
    tmp_path, prefect_home, sig, reason, code
):
    """`python -m flows.sft`: its ranks stream MDS shards through shared memory."""
    shm_before = set(os.listdir(SHM))
    out = tmp_path / "out.txt"
    proc = _start_pipeline(prefect_home, out, "sft", LONG_SFT)
    procs: list[psutil.Process] = []
    try:
        _wait_training(proc, out)
        procs = _run_processes(proc.pid)
        in_use = _shm_in_use(procs)
        os.killpg(proc.pid, sig)  # what a terminal (Ctrl-C) or `timeout`/systemd sends
        stopped_at = time.monotonic()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 15 s after {sig.name}:\n{out.read_text()[-4000:]}")
        took = time.monotonic() - stopped_at
        survivors = processes.survivors(procs, 10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        processes.kill_all(procs)
    text = out.read_text()
    assert proc.returncode == code, text[-4000:]
    assert survivors == [], [(p.pid, p.cmdline()) for p in survivors]
    client, run = _only_run("sft")
    assert run.info.status == "KILLED", text[-4000:]
    assert client.search_model_versions(f"name='{LONG_SFT['registered_model_name']}'") == []
    run_id = run.info.run_id
    assert (
        f"stopped: {reason}; MLflow run {run_id} is KILLED. "
        f"Continue it with: python -m flows.sft --resume {run_id}"
    ) in text
    # The ranks checkpointed the step they reached, and left no half-written checkpoint.
    checkpoints = Path(os.environ["TRAINFLOW_HOME"], "outputs", "sft", run_id, "checkpoints")
    kept = complete_checkpoints(checkpoints)
    assert kept, f"no checkpoint at the step reached:\n{text[-4000:]}"
    folders = sorted(p.name for p in checkpoints.iterdir() if p.is_dir())
    assert folders == sorted(p.name for p in kept)  # nothing partial beside them
    assert "Traceback" not in text, text[-4000:]
    assert text.count("Starting temporary server") == 1  # ours; Prefect started none of its own
    assert _shm_left(shm_before, in_use, procs) == []
    print(f"{sig.name}: exited {code} after {took:.1f} s")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "0"], "--gpus: Input should be greater than or equal to 1"),
        (["--gpus", "8", "--gpu-type", "H100"], "H100"),
    ],
    ids=["invalid-option", "missing-gpus"],
)
def test_usage_errors_exit_before_any_server_starts(prefect_home, args, message):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(prefect_home)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "flows.mlp", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "temporary server" not in proc.stdout + proc.stderr
    assert took < 30, f"a usage error took {took:.0f} s"


def test_killed_flow_process_leaves_nothing_running_and_its_run_is_reaped(tmp_path, prefect_home):
    out = tmp_path / "out.txt"
    proc = _start_pipeline(prefect_home, out)
    procs: list[psutil.Process] = []
    try:
        _wait_training(proc, out)
        procs = _run_processes(proc.pid)
        proc.kill()  # the flow process alone: its server, guard and ranks get no signal
        proc.wait()
        survivors = processes.survivors(procs, 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        processes.kill_all(procs)
    assert survivors == [], [(p.pid, p.cmdline()) for p in survivors]
    client, run = _only_run()
    assert run.info.status == "RUNNING"  # nobody was left to end it
    assert run.data.tags[tracking.OWNER_PID_TAG] == str(proc.pid)

    # The next pipeline on this store finds its owner gone and ends it.
    with tracking.pipeline_run("mlp", "next", params={}) as next_run:
        pass
    killed = client.get_run(run.info.run_id)
    assert killed.info.status == "FAILED"
    assert killed.data.tags[tracking.FAILURE_REASON_TAG] == (
        f"the process that ran it (pid {proc.pid} on {socket.gethostname()}) exited "
        "without ending the run (killed or crashed)"
    )
    assert client.get_run(next_run).info.status == "FINISHED"


def test_cancelling_a_served_deployment_run_kills_its_ranks_and_run(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    env = {**os.environ, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        serve = subprocess.Popen(
            [sys.executable, "-c", SERVE, SERVED],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    procs: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while "being served" not in log.read_text(errors="replace"):
            assert serve.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name(f"mlp/{SERVED}")
            flow_run = client.create_flow_run_from_deployment(
                deployment.id, parameters={"config": {"gpus": 2, "gpu_type": "cpu", **LONG}}
            )
            _wait_training(
                serve, log, ended=lambda: client.read_flow_run(flow_run.id).state.is_final()
            )
            # The flow run's process, the launcher's agent and the ranks (not the server).
            procs = psutil.Process(serve.pid).children(recursive=True)
            ranks = [p for p in procs if "trainflow.launch.agent" in " ".join(p.cmdline())]
            assert len(ranks) >= 3, [p.cmdline() for p in procs]  # the agent and 2 ranks
            client.set_flow_run_state(flow_run.id, Cancelling())  # what the UI's Cancel does
            cancelled_at = time.monotonic()
            survivors = processes.survivors(ranks, 10)
            took = time.monotonic() - cancelled_at
            deadline = time.monotonic() + 60
            while not (state := client.read_flow_run(flow_run.id).state).is_final():
                assert time.monotonic() < deadline, f"flow run still {state.name}"
                time.sleep(0.5)
        left = processes.survivors(procs, 10)
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        processes.kill_all(procs)
    text = log.read_text(errors="replace")[-4000:]
    assert survivors == [], [(p.pid, p.cmdline()) for p in survivors]
    assert left == [], [(p.pid, p.cmdline()) for p in left]
    assert state.is_cancelled(), f"{state.name}: {text}"
    mlflow, run = _only_run()
    assert run.info.status == "KILLED", text
    assert mlflow.search_model_versions(f"name='{LONG['registered_model_name']}'") == []
    print(f"cancel: ranks gone after {took:.1f} s")
