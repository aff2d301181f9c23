"""Real launches asked for in the new spelling (`num_accelerators`, `accelerator_type`).

There is no GPU here, so the accelerator types' GPUs run as CPU ranks with
TRAINFLOW_CPU_FALLBACK=1, as the notebook cells do; the ranks are real gloo ranks of a real
elastic agent. Two agents on this machine stand in for two nodes (same rendezvous endpoint and
run id), as in test_launcher.
"""

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from tests.conftest import call_on_nodes, free_port
from trainflow import LaunchTimeoutError, distributed, runtime
from trainflow.launch import decorator
from trainflow.launch.plan import GpuInventory


@pytest.fixture(autouse=True)
def _cpu_fallback(monkeypatch):
    if GpuInventory.detect().count:
        pytest.skip("this machine has GPUs: the CPU fallback these tests rely on does not apply")
    monkeypatch.setenv("TRAINFLOW_CPU_FALLBACK", "1")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def where_am_i() -> dict:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {
        "rank": runtime.get_global_rank(),
        "node": runtime.get_node_rank(),
        "world": runtime.get_world_size(),
        "local_world": runtime.get_local_world_size(),
        "device": str(runtime.get_device()),
        "sum": t.item(),
    }


def test_gpu_8xh100_with_two_runs_two_ranks_on_one_node(capfd):
    fn = distributed(num_accelerators=2, accelerator_type="GPU_8xH100", init_process_group=True)(
        where_am_i
    )
    results = fn.distributed()
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["local_world"] == 2 and r["node"] == 0 for r in results)
    assert all(r["device"] == "cpu" and r["sum"] == 3.0 for r in results)
    err = capfd.readouterr().err
    assert err.count("where_am_i.distributed() stops its ranks after 3 h") == 1


def test_gpu_1xa10_with_two_runs_one_rank_on_each_of_two_nodes(monkeypatch):
    monkeypatch.setenv("TRAINFLOW_RDZV_ENDPOINT", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("TRAINFLOW_RUN_ID", "a10-two-nodes")
    fn = distributed(2, "GPU_1xA10", timeout=180, init_process_group=True)(where_am_i)
    assert (fn.options.gpus, fn.options.nnodes) == (2, 2)
    per_node = call_on_nodes(fn.distributed)
    assert sorted(len(values) for values in per_node) == [1, 1]
    ranks = sorted((v for values in per_node for v in values), key=lambda r: r["rank"])
    assert [(r["rank"], r["node"]) for r in ranks] == [(0, 0), (1, 1)]
    assert all(r["world"] == 2 and r["local_world"] == 1 and r["sum"] == 3.0 for r in ranks)


def sleep_with_a_child(folder: str) -> None:
    rank = runtime.get_global_rank()
    child = subprocess.Popen(["sleep", "120"], start_new_session=True)
    Path(folder, f"child_{rank}").write_text(str(child.pid))
    Path(folder, f"pid_{rank}").write_text(str(os.getpid()))
    time.sleep(120)


@pytest.mark.parametrize("given", ["default", "explicit"])
def test_past_the_timeout_every_rank_is_stopped_and_named(tmp_path, monkeypatch, capfd, given):
    """The default is `decorator.DEFAULT_TIMEOUT_S`, read when the decorator runs: here it is
    made 6 s rather than 3 h, and the call takes the same path."""
    if given == "default":
        monkeypatch.setattr(decorator, "DEFAULT_TIMEOUT_S", 6.0)
        fn = distributed(num_accelerators=2, accelerator_type="GPU_8xH100")(sleep_with_a_child)
    else:
        fn = distributed(2, "GPU_8xH100", timeout=6)(sleep_with_a_child)
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as info:
        fn.distributed(str(tmp_path))
    assert time.monotonic() - start < 60
    assert info.value.running_ranks == [0, 1]
    assert "timed out after 6s" in str(info.value)
    assert "rank(s) 0, 1 still running were stopped" in str(info.value)
    notes = capfd.readouterr().err.count("stops its ranks after 6 s (timeout=6 s, the default)")
    assert notes == (1 if given == "default" else 0)
    pids = [int(p.read_text()) for name in ("pid_*", "child_*") for p in tmp_path.glob(name)]
    assert len(pids) == 4, "the ranks did not start"
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in pids if _alive(p)] == [], "a rank or a process it started outlived it"


def test_with_overrides_changes_the_launch_and_not_the_original():
    one = distributed(
        num_accelerators=1, accelerator_type="GPU_8xH100", timeout=120, init_process_group=True
    )(where_am_i)
    two = one.with_overrides(num_accelerators=2)
    assert [(r["rank"], r["world"]) for r in two.distributed()] == [(0, 2), (1, 2)]
    assert [(r["rank"], r["world"]) for r in one.distributed()] == [(0, 1)]
