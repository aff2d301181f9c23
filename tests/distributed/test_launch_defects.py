"""Launch defects, each checked on real launches (gloo on CPU): CPU ranks bounded by the cores,
listening sockets on loopback only, hang errors that name the rank, collective and wait, the
data streams' shared memory released after a failure, nothing left in the temp folder.
"""

import os
import signal
import socket
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from tests.conftest import free_port
from tests.distributed.test_ray_multinode import ray_cluster  # noqa: F401 - the fixture
from trainflow import distributed, runtime
from trainflow.errors import HangError, RankError
from trainflow.launch.plan import GpuInventory, ResourceError
from trainflow.paths import trainflow_home

LOOPBACK = {"127.0.0.1", "::1"}


def _temp_entries() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("trainflow-")}


# A. CPU ranks are bounded by the cores


def add_one(x: int) -> int:
    return x + 1


def test_a_thousand_cpu_ranks_on_this_machine_are_refused_before_anything_starts():
    fn = distributed(gpus=1000, gpu_type="cpu")(add_one)
    with pytest.raises(ResourceError) as info:
        fn.distributed(1)
    message = str(info.value)
    cores = os.cpu_count()
    assert f"would start 1000 CPU ranks on a node with {cores} cores" in message
    assert f"at most {4 * cores} (4 per core)" in message
    assert "TRAINFLOW_MAX_CPU_RANKS" in message
    assert info.value.__cause__ is None and info.value.__context__ is None
    assert not (trainflow_home() / "runs").exists()  # no run folder, no agent, no rank


def test_an_explicit_limit_overrides_the_cores(monkeypatch):
    monkeypatch.setenv("TRAINFLOW_MAX_CPU_RANKS", "1")
    with pytest.raises(ResourceError, match=r"at most 1 \(TRAINFLOW_MAX_CPU_RANKS=1\)"):
        distributed(gpus=2, gpu_type="cpu")(add_one).distributed(1)
    monkeypatch.setenv("TRAINFLOW_MAX_CPU_RANKS", "lots")
    with pytest.raises(ResourceError, match="TRAINFLOW_MAX_CPU_RANKS='lots'"):
        distributed(gpus=2, gpu_type="cpu")(add_one).distributed(1)


def test_more_gpus_than_attached_are_refused_before_anything_starts(monkeypatch):
    """One (faked) H100 attached: 8 are refused at the call, naming what the machine has."""
    monkeypatch.delenv("TRAINFLOW_CPU_FALLBACK", raising=False)
    one = GpuInventory(("NVIDIA H100 80GB HBM3",))
    monkeypatch.setattr(GpuInventory, "detect", classmethod(lambda cls: one))
    fn = distributed(gpus=8, gpu_type="H100")(add_one)
    with pytest.raises(ResourceError, match="needs 8 GPUs per node of type 'H100'.*1x NVIDIA H100"):
        fn.distributed(1)
    assert not (trainflow_home() / "runs").exists()


# B. Listening sockets: loopback only


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    found = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        found |= {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    return sorted(found)


@distributed(gpus=2, gpu_type="cpu", init_process_group=True, timeout=120)
def listening_sockets_of_the_launch() -> list[tuple[str, int]]:
    dist.barrier()  # every store and process group is up
    found: list[tuple[str, int]] = []
    if runtime.get_global_rank() == 0:
        agent = psutil.Process(os.getppid())
        found = _listening([agent.pid] + [p.pid for p in agent.children(recursive=True)])
    dist.barrier()
    return found


def test_a_launch_listens_on_loopback_only():
    found, _ = listening_sockets_of_the_launch.distributed()
    assert len(found) >= 2, found  # the rendezvous store and the store at MASTER_PORT
    assert [(ip, port) for ip, port in found if ip not in LOOPBACK] == []


def test_a_launch_board_listens_only_on_the_address_it_is_given():
    from trainflow.launch.board import Board

    port = free_port()
    board = Board(f"127.0.0.1:{port}")
    try:
        found = [a for a in _listening([os.getpid()]) if a[1] == port]
        assert found == [("127.0.0.1", port)]
    finally:
        board.close()


def test_the_node_address_toward_a_host_is_the_interface_the_route_takes():
    from trainflow.launch.listen import node_address

    assert node_address("127.0.0.1") == "127.0.0.1"
    assert node_address("localhost") in LOOPBACK
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: never reached, only routed
        assert node_address("192.0.2.1") == probe.getsockname()[0]


# C and D. Hang errors name rank, collective and wait; shared memory is released


def _write_mds(folder: Path) -> str:
    from streaming import MDSWriter

    with MDSWriter(out=str(folder), columns={"x": "int"}) as writer:
        for i in range(64):
            writer.write({"x": i})
    return str(folder)


def _streaming_step(path: str, out: str):
    """Open a streaming dataset (its shared memory lives as long as the rank), note its prefix."""
    from streaming import StreamingDataset

    dataset = StreamingDataset(local=path, batch_size=4, shuffle=False)
    first = next(iter(dataset))
    Path(out, f"prefix_{runtime.get_global_rank()}").write_text(str(dataset._shm_prefix_int))
    return dataset, first


@distributed(gpus=2, gpu_type="cpu", timeout=120, init_process_group=True, hang_timeout=4)
def streams_then_rank_one_stalls(path: str, out: str) -> None:
    dataset, _ = _streaming_step(path, out)
    rank = runtime.get_global_rank()
    for step in range(1, 1000):
        runtime.heartbeat(step)
        if rank == 1 and step == 3:
            time.sleep(600)  # rank 0 waits for it in the all-reduce
        dist.all_reduce(torch.ones(1))


@distributed(gpus=2, gpu_type="cpu", timeout=120, init_process_group=True, collective_timeout=5)
def streams_then_rank_one_goes_silent(path: str, out: str) -> None:
    dataset, _ = _streaming_step(path, out)
    rank = runtime.get_global_rank()
    for step in range(1, 1000):
        runtime.heartbeat(step)
        if rank == 1 and step == 3:
            time.sleep(600)
        dist.barrier()


@distributed(gpus=2, gpu_type="cpu", timeout=120, init_process_group=True)
def streams_then_rank_one_raises(path: str, out: str) -> None:
    dataset, _ = _streaming_step(path, out)
    dist.barrier()
    if runtime.get_global_rank() == 1:
        raise ValueError("bad shard")
    time.sleep(600)


def _shm_of(out: Path) -> list[str]:
    prefixes = {int(p.read_text()) for p in out.glob("prefix_*")}
    assert prefixes, "the ranks opened no dataset"
    names = os.listdir("/dev/shm")
    return sorted(n for n in names for p in prefixes if n.startswith(f"{p:06d}_"))


def test_a_stalled_rank_is_named_with_the_collective_its_peer_waits_in_and_its_memory_freed(
    tmp_path,
):
    mds, out = _write_mds(tmp_path / "mds"), tmp_path / "out"
    out.mkdir()
    with pytest.raises(HangError) as info:
        streams_then_rank_one_stalls.distributed(mds, str(out))
    err, text = info.value, str(info.value)
    assert err.stuck_ranks == [1], text
    assert "no rank's heartbeat advanced for 4s" in text
    assert "rank 1 stopped answering: rank 0 waited " in text
    waited = int(text.split("rank 0 waited ", 1)[1].split("s", 1)[0])
    assert 4 <= waited <= 30
    assert "for it in all_reduce()" in text
    assert "Stack of rank 1 (last step 3)" in text and "time.sleep(600)" in text
    assert _shm_of(out) == []


def test_a_silent_peer_is_named_with_the_collective_and_the_seconds_waited(tmp_path):
    mds, out = _write_mds(tmp_path / "mds"), tmp_path / "out"
    out.mkdir()
    with pytest.raises(HangError) as info:
        streams_then_rank_one_goes_silent.distributed(mds, str(out))
    text = str(info.value)
    assert info.value.stuck_ranks == [1]
    assert "rank 1 stopped answering: rank 0 timed out after 5s waiting for it in barrier()" in (
        text
    )
    assert _shm_of(out) == []


def test_a_rank_error_frees_the_streams_shared_memory(tmp_path):
    mds, out = _write_mds(tmp_path / "mds"), tmp_path / "out"
    out.mkdir()
    with pytest.raises(RankError, match="bad shard"):
        streams_then_rank_one_raises.distributed(mds, str(out))
    assert _shm_of(out) == []


# G. Nothing left in the temp folder


@distributed(gpus=2, gpu_type="cpu", timeout=120)
def fails_on_rank_one() -> int:
    if runtime.get_global_rank() == 1:
        raise ValueError("bad")
    return 1


@pytest.fixture
def own_temp(tmp_path, monkeypatch) -> Path:
    """A temp folder of this test's own for the caller and every process the launch starts:
    other runs on the machine do not show in it."""
    folder = tmp_path / "temp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _trainflow_entries(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("trainflow"))


def test_local_launches_leave_nothing_in_the_temp_folder(own_temp):
    assert listening_sockets_of_the_launch.distributed()
    with pytest.raises(RankError):
        fails_on_rank_one.distributed()
    assert _trainflow_entries(own_temp) == []


def test_a_leader_killed_mid_launch_leaves_nothing_in_the_temp_folder(tmp_path, own_temp):
    from tests.distributed.test_follow import _alive, _left, _Nodes

    nodes = _Nodes(tmp_path, "hang")
    try:
        deadline = time.monotonic() + 90
        while not all((nodes.out / f"hang-{i}.json").exists() for i in (0, 1)):
            assert nodes.leader.poll() is None, nodes.text("leader")
            assert time.monotonic() < deadline, nodes.text("follower")
            time.sleep(0.1)
        time.sleep(0.3)
        ranks = [nodes.rank("hang", i) for i in (0, 1)]
        pids = {p for r in ranks for p in (r["pid"], r["agent"])}
        assert all(_alive(p) for p in pids)
        nodes.leader.send_signal(signal.SIGKILL)
        nodes.wait(nodes.follower, 30)
        assert _left(pids) == []
        assert _trainflow_entries(own_temp) == []
    finally:
        nodes.close()


@pytest.mark.slow
def test_ray_node_launches_leave_nothing_in_the_temp_folder(ray_cluster):  # noqa: F811
    """Ray's workers keep the cluster's temp folder (the system's): the node folders new in it
    are counted, which another Ray run on the machine would add to."""
    before = _temp_entries()
    on_two_nodes = distributed(gpus=2, gpu_type="cpu", nnodes=2)
    assert on_two_nodes(add_one).distributed(1) == [2, 2]
    with pytest.raises(RankError):
        on_two_nodes(fails_on_rank_one).distributed()
    left = {n for n in _temp_entries() - before if n.startswith("trainflow-node-")}
    assert left == set()


# F. remote=True: progress while it waits; the caller's file, lines and exception chain


NOTEBOOK = '''
import json, os, sys
from pathlib import Path

import trainflow.launch.prefect_adapter as adapter
from trainflow import distributed


def submitted(name, parameters, timeout):
    """Stands in for the Prefect server: keeps what would be submitted."""
    Path(sys.argv[1]).write_text(json.dumps(parameters))
    raise SystemExit(0)


adapter.run_deployment = submitted
os.environ["TRAINFLOW_REMOTE_DEPLOYMENT"] = "remote-call/test"


@distributed(gpus=2, gpu_type="cpu", remote=True, timeout=120)
def cell(x):
    table = {"a": 1}
    try:
        return table["missing"]
    except KeyError as exc:
        raise ValueError(f"cell failed on {x}") from exc


cell.distributed(7)
'''


def test_a_remote_call_keeps_the_callers_file_lines_and_exception_chain(tmp_path):
    """The worker's side of a remote call, run here on what the caller submitted, with the
    caller's script gone (as on another machine); the error then travels back pickled, as
    Prefect keeps a failed run's exception."""
    import base64
    import json
    import subprocess
    import sys

    import cloudpickle

    from tests.conftest import REPO_ROOT
    from trainflow import LaunchOptions, launch

    script, submitted = tmp_path / "notebook.py", tmp_path / "submitted.json"
    script.write_text(NOTEBOOK)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), str(submitted)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    script.unlink()  # the worker's machine has no copy of the caller's script
    parameters = json.loads(submitted.read_text())
    fn, args, kwargs = cloudpickle.loads(base64.b64decode(parameters["payload"]))
    options = LaunchOptions(**{**parameters["options"], "remote": False})
    with pytest.raises(RankError) as info:
        launch(fn, args, kwargs, options=options)
    error = cloudpickle.loads(cloudpickle.dumps(info.value))
    text = str(error)
    assert f'File "{script}", line 23, in cell' in text, text
    assert 'return table["missing"]' in text
    assert f'File "{script}", line 25, in cell' in text
    assert 'raise ValueError(f"cell failed on {x}") from exc' in text
    assert "<dynamic-code>" not in text
    assert isinstance(error.__cause__, ValueError) and str(error.__cause__) == "cell failed on 7"


def test_a_remote_call_says_how_its_flow_run_goes_while_it_waits(prefect_api):
    """Queued, running, the ranks' lines, the end: each said once, as the run goes."""
    import datetime
    import threading

    from prefect import flow, get_client
    from prefect.client.schemas.actions import LogCreate
    from prefect.states import Completed, Running, Scheduled

    from trainflow.launch.prefect_adapter import follow_flow_run

    @flow(name="remote-progress")
    def remote_progress() -> None:
        pass

    said: list[str] = []

    def until(what: str) -> None:
        deadline = time.monotonic() + 30
        while not any(what in line for line in said) and time.monotonic() < deadline:
            time.sleep(0.1)

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(remote_progress, state=Scheduled())
        follower = threading.Thread(
            target=follow_flow_run, args=(run.id, "cell.distributed()", said.append)
        )
        follower.start()
        until("queued")
        client.set_flow_run_state(run.id, Running(), force=True)
        until("running")
        now = datetime.datetime.now(datetime.UTC)
        line = LogCreate(
            name="prefect.task_runs",
            level=20,
            message="[rank 1] loss 0.5",
            timestamp=now,
            flow_run_id=run.id,
        )
        client.create_logs([line])
        until("[rank 1] loss 0.5")
        client.set_flow_run_state(run.id, Completed(), force=True)
        follower.join(timeout=30)
    assert not follower.is_alive()
    assert said[0].startswith(f"[trainflow] cell.distributed(): flow run {run.name} queued")
    assert "waiting for a worker" in said[0]
    running = [i for i, line in enumerate(said) if "running" in line]
    rank = said.index("[remote] [rank 1] loss 0.5")
    ended = [i for i, line in enumerate(said) if "ended Completed" in line]
    assert running and ended and running[0] < rank < ended[0], said


def test_a_store_server_on_torch_without_a_libuv_listen_socket_falls_back_to_the_older_backend():
    # torch 2.7 (LLM Foundry's environment): the libuv backend refuses a listening socket.
    from trainflow.launch.listen import tcp_store_server

    made: list[dict] = []

    class Store:
        def __init__(self, host, port, is_master, master_listen_fd, **kwargs):
            made.append({"fd": master_listen_fd, "port": port, **kwargs})
            if kwargs.get("use_libuv", True):
                raise NotImplementedError("The libuv TCPStore backend does not support ...")
            self.port = port

    store = tcp_store_server(Store, "127.0.0.1", 0, multi_tenant=True)
    assert [m.get("use_libuv", True) for m in made] == [True, False]
    assert all(m["multi_tenant"] for m in made)
    listening = _listening([os.getpid()])
    assert ("127.0.0.1", made[0]["port"]) not in listening  # the refused socket was closed
    assert listening.count(("127.0.0.1", store.port)) == 1
    os.close(made[1]["fd"])


@distributed(gpus=2, gpu_type="cpu", timeout=120)
def fails_on_every_rank() -> None:
    raise ValueError(f"rank {runtime.get_global_rank()} fails on purpose")


def test_a_rank_failure_is_recorded_once_atomically_and_not_in_torchs_error_file():
    # torch elastic writes a failed rank's error.json in place; a rank killed mid-write left it
    # empty and the agent crashed parsing it instead of restarting the ranks.
    with pytest.raises(RankError, match="fails on purpose") as info:
        fails_on_every_rank.distributed()
    logs = Path(str(info.value).rpartition("Rank logs: ")[2].split()[0])
    assert logs.name == "logs" and (logs.parent / "elastic").is_dir()
    assert list(logs.parent.rglob("error.json")) == []
