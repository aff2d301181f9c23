"""Real 2-rank launches (gloo on CPU) through `trainflow.distributed`."""

import os
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from tests.conftest import call_on_nodes, free_port
from trainflow import (
    LaunchError,
    LaunchTimeoutError,
    PayloadError,
    RankError,
    distributed,
    runtime,
)
from trainflow.paths import trainflow_home


class Point:
    """Defined in an importable module: ranks unpickle it by name via the caller's sys.path."""

    def __init__(self, x: int):
        self.x = x


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _read_pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(folder.glob("pid_*"))]


@distributed(gpus=2, gpu_type="cpu", timeout=120)
def rank_and_arg(value: int, *, point: Point) -> dict:
    return {"rank": runtime.get_global_rank(), "value": value * 10, "point": point.x}


def test_results_are_ordered_by_rank_and_arguments_travel():
    results = rank_and_arg.distributed(4, point=Point(7))
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["value"] == 40 and r["point"] == 7 for r in results)


def test_direct_call_runs_in_process():
    assert rank_and_arg(2, point=Point(1)) == {"rank": 0, "value": 20, "point": 1}


@distributed(gpus=2, gpu_type="cpu", timeout=120, env={"MY_SETTING": "forwarded"})
def environment() -> dict:
    names = [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
        "MY_SETTING",
        "CUDA_VISIBLE_DEVICES",
        "HF_TOKEN",
    ]
    return {
        "env": {n: os.environ.get(n) for n in names},
        "helpers": (
            runtime.get_global_rank(),
            runtime.get_local_rank(),
            runtime.get_world_size(),
            runtime.get_local_world_size(),
            runtime.get_node_rank(),
            runtime.is_rank_zero(),
        ),
        "device": str(runtime.get_device()),
        "threads": torch.get_num_threads(),
    }


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_every_rank_sees_the_torchrun_environment_and_helpers_agree(start_method, monkeypatch):
    monkeypatch.setenv("TRAINFLOW_START_METHOD", start_method)
    monkeypatch.setenv("HF_TOKEN", "hf_secretValue42")
    results = environment.distributed()
    for rank, res in enumerate(results):
        env = res["env"]
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["NODE_RANK"] == "0"
        assert env["MASTER_ADDR"] and int(env["MASTER_PORT"]) > 0
        assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")
        assert res["threads"] == int(env["OMP_NUM_THREADS"])  # honoured, as under torchrun
        assert env["MY_SETTING"] == "forwarded"
        assert env["HF_TOKEN"] == "hf_secretValue42"  # secrets reach ranks by environment
        assert env["CUDA_VISIBLE_DEVICES"] == ""  # CPU ranks never see a GPU
        assert res["helpers"] == (rank, rank, 2, 2, 0, rank == 0)
        assert res["device"] == "cpu"
    assert results[0]["env"]["MASTER_PORT"] == results[1]["env"]["MASTER_PORT"]
    run_files = [p for p in (trainflow_home() / "runs").rglob("*") if p.is_file()]
    assert run_files and not [p for p in run_files if b"hf_secretValue42" in p.read_bytes()]
    assert not [p for p in run_files if b"forwarded" in p.read_bytes()]  # env= values too


def test_runtime_helpers_outside_a_launch_are_rank_zero_of_one(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert runtime.get_global_rank() == 0 and runtime.get_world_size() == 1
    assert runtime.get_local_rank() == 0 and runtime.get_local_world_size() == 1
    assert runtime.get_node_rank() == 0 and runtime.is_rank_zero()


@distributed(gpus=2, gpu_type="cpu", timeout=120)
def user_initialised_group() -> float:
    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()
    finally:
        dist.destroy_process_group()


def test_user_code_may_initialise_its_own_process_group():
    assert user_initialised_group.distributed() == [3.0, 3.0]


@distributed(gpus=2, gpu_type="cpu", timeout=120, init_process_group=True)
def managed_group() -> tuple:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_backend(), t.item()


def test_init_process_group_true_gives_a_gloo_group_on_cpu():
    assert managed_group.distributed() == [("gloo", 3.0), ("gloo", 3.0)]


@distributed(gpus=2, gpu_type="cpu", timeout=120, init_process_group=True)
def fail_on_rank_one(pid_dir: str) -> None:
    Path(pid_dir, f"pid_{runtime.get_global_rank()}").write_text(str(os.getpid()))
    if runtime.get_global_rank() == 1:
        time.sleep(0.5)
        raise ValueError("bad batch on rank one")
    dist.barrier()  # rank 0 blocks here until it is stopped
    time.sleep(600)


def test_error_on_one_rank_names_it_and_stops_the_others(tmp_path, monkeypatch):
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(system_tmp))  # the agent's and the ranks' temp folder
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        fail_on_rank_one.distributed(str(tmp_path))
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == 1 and 1 in err.failed_ranks  # rank 0 may fail after, in its barrier
    assert err.exc_type == "builtins.ValueError"
    assert isinstance(err.__cause__, ValueError)
    assert "rank 1 failed" in str(err) and "ValueError: bad batch on rank one" in str(err)
    assert "fail_on_rank_one" in err.remote_traceback  # the rank's own traceback text
    assert Path(err.log_dir, "rank_1.log").exists()
    assert elapsed < 60, f"the surviving rank was not stopped promptly ({elapsed:.0f}s)"
    pids = _read_pids(tmp_path)
    assert len(pids) == 2 and not any(_alive(p) for p in pids)
    # torch's per-rank error files stay with the launch's logs, not in the system's temp folder
    # (whether rank 1 writes one depends on whether it exits before the launcher stops it)
    assert not list(system_tmp.glob("pytorch-errorfile-*"))
    assert Path(err.log_dir).parent.joinpath("elastic", "tmp").is_dir()


@distributed(gpus=2, gpu_type="cpu", timeout=12)
def hang(pid_dir: str) -> None:
    Path(pid_dir, f"pid_{runtime.get_global_rank()}").write_text(str(os.getpid()))
    time.sleep(600)


def test_timeout_stops_a_hung_launch_and_names_running_ranks(tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as info:
        hang.distributed(str(tmp_path))
    assert time.monotonic() - start < 40
    assert info.value.running_ranks == [0, 1]
    assert "timed out after 12s" in str(info.value) and "0, 1" in str(info.value)
    pids = _read_pids(tmp_path)
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


def test_unpicklable_argument_fails_before_anything_starts():
    @distributed(gpus=2, gpu_type="cpu")
    def takes(data, lock):
        return data

    with pytest.raises(PayloadError, match=r"argument 'lock' .*lock"):
        takes.distributed([1, 2], threading.Lock())
    with pytest.raises(PayloadError, match="cannot be called with these arguments"):
        takes.distributed(1, 2, 3)
    assert not (trainflow_home() / "runs").exists()


def test_closures_and_lambdas_travel_by_value():
    offset = 5

    @distributed(gpus=2, gpu_type="cpu", timeout=120)
    def add(x):
        return (lambda y: y + offset + runtime.get_global_rank())(x)

    assert add.distributed(1) == [6, 7]


@distributed(gpus=2, gpu_type="cpu", timeout=120)
def die_hard() -> None:
    if runtime.get_global_rank() == 0:
        os._exit(13)
    time.sleep(600)


def test_rank_dying_without_python_error_is_reported_with_exit_code():
    with pytest.raises(LaunchError) as info:
        die_hard.distributed()
    assert not isinstance(info.value, RankError)
    assert "exitcode  : 13" in str(info.value) or "exit code 13" in str(info.value)


@distributed(gpus=2, gpu_type="cpu", timeout=120, init_process_group=True, max_restarts=1)
def flaky_first_attempt() -> tuple:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and dist.get_rank() == 1:
        raise RuntimeError("transient failure")
    t = torch.ones(1)
    dist.all_reduce(t)
    return attempt, t.item()


def test_restart_recovers_from_a_failed_attempt():
    assert flaky_first_attempt.distributed() == [(1, 2.0), (1, 2.0)]


@distributed(gpus=2, gpu_type="cpu", timeout=120, init_process_group=True)
def all_reduce_sum(x: float) -> float:
    t = torch.tensor([x + dist.get_rank()])
    dist.all_reduce(t)
    return t.item()


def test_two_concurrent_launches_do_not_collide():
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = all_reduce_sum.distributed(float(i * 100))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == {1: [201.0, 201.0], 2: [401.0, 401.0]}
    runs = list((trainflow_home() / "runs").iterdir())
    assert len(runs) == 2  # each launch has its own run directory


@distributed(gpus=2, gpu_type="cpu", timeout=120)
def talk() -> None:
    print(f"hello from rank {runtime.get_global_rank()}")
    print("partial line without newline", end="")


def test_rank_output_is_forwarded_line_by_line_with_rank(capfd):
    talk.distributed()
    out = capfd.readouterr().out
    assert "[rank 0] hello from rank 0" in out
    assert "[rank 1] hello from rank 1" in out
    assert "[rank 1] partial line without newline" in out
    logs = sorted((trainflow_home() / "runs").glob("*/logs/rank_1.log"))
    assert logs and "hello from rank 1" in logs[0].read_text()


@distributed(gpus=4, gpu_type="cpu", nnodes=2, timeout=180, init_process_group=True)
def two_node_sum() -> tuple:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return runtime.get_global_rank(), runtime.get_node_rank(), runtime.get_world_size(), t.item()


def test_two_nodes_rendezvous_through_torch_elastic(monkeypatch):
    """Two agents on one machine stand in for two nodes: same endpoint, same run id."""
    monkeypatch.setenv("TRAINFLOW_RDZV_ENDPOINT", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("TRAINFLOW_RUN_ID", "two-node-test")
    results = call_on_nodes(two_node_sum.distributed)
    ranks = sorted(r for node_results in results for r in node_results)
    assert [r[0] for r in ranks] == [0, 1, 2, 3]
    assert sorted({r[1] for r in ranks}) == [0, 1]
    assert all(r[2] == 4 and r[3] == 6.0 for r in ranks)
    assert all(len(node_results) == 2 for node_results in results)


def test_two_nodes_without_a_rendezvous_endpoint_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRAINFLOW_RDZV_ENDPOINT", raising=False)
    with pytest.raises(LaunchError, match="TRAINFLOW_RDZV_ENDPOINT=host:port"):
        two_node_sum.distributed()


@distributed(gpus=2, gpu_type="cpu", timeout=120)
def returns_a_lock():
    return threading.Lock() if runtime.get_global_rank() == 1 else "fine"


def test_unpicklable_return_value_names_the_rank():
    with pytest.raises(RankError, match="rank 1 failed while sending the return value back"):
        returns_a_lock.distributed()
