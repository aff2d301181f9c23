"""Multi-node launches on a real Ray cluster: two Ray nodes on this machine, CPU ranks (gloo).

`ray.cluster_utils.Cluster` starts a head (no CPUs, so no rank lands there) and two worker
nodes, each with one CPU: a 2-node job gets one rank per Ray node, placed by Ray. Every Ray
process the module started is stopped through the cluster's own handles (never `ray stop`,
which would stop every Ray process on the machine), and the test checks they are gone.
"""

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

ray = pytest.importorskip("ray")

from prefect import flow, get_client  # noqa: E402
from prefect.client.schemas.sorting import LogSort  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from flows.techniques import techniques  # noqa: E402
from tests.conftest import flush_prefect_logs  # noqa: E402
from trainflow import distributed, runtime  # noqa: E402
from trainflow.configs.mlp import MLPConfig  # noqa: E402
from trainflow.errors import LaunchError  # noqa: E402
from trainflow.launch.ray_placement import NodeLostError  # noqa: E402
from trainflow.paths import trainflow_home  # noqa: E402
from trainflow.resources import Resources  # noqa: E402
from trainflow.strategies import DDPConfig  # noqa: E402
from trainflow.strategies.job import Workload  # noqa: E402
from trainflow.workloads import mlp  # noqa: E402

pytestmark = pytest.mark.slow


def _node_pids(node) -> list[int]:
    return [p.process.pid for procs in node.all_processes.values() for p in procs]


@pytest.fixture(scope="module")
def ray_cluster():
    # Ray's session folders (logs, sockets) otherwise stay in /tmp/ray after it stops: give it
    # a folder of its own (short, for its socket paths) and remove it after.
    old_temp = os.environ.get("RAY_TMPDIR")
    ray_temp = tempfile.mkdtemp(prefix="ray-")
    os.environ["RAY_TMPDIR"] = ray_temp
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    started = _node_pids(cluster.head_node) + [p for w in workers for p in _node_pids(w)]
    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for node in list(cluster.worker_nodes):
            started += _node_pids(node)
        cluster.shutdown()
        if old is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old
        if old_temp is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old_temp
        shutil.rmtree(ray_temp, ignore_errors=True)
        alive = [pid for pid in set(started) if psutil.pid_exists(pid)]
        alive = [p for p in alive if psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"Ray processes left running: {alive}"


def ddp_steps(steps: int, seed: int) -> dict:
    """A few DDP steps of a tiny linear model: gradients after the all-reduce, final loss."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(seed)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = runtime.get_global_rank()
    gen = torch.Generator().manual_seed(seed + rank)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    print(f"node {runtime.get_node_rank()} final loss {loss.item():.6f}", flush=True)
    return {
        "rank": rank,
        "node_rank": runtime.get_node_rank(),
        "world": runtime.get_world_size(),
        "ray_node": os.environ.get("TRAINFLOW_RAY_NODE_ID"),
        "grads": grads.tolist(),
        "loss": loss.item(),
        "weights": [p.detach().flatten().tolist() for p in model.parameters()],
    }


def test_two_nodes_one_rank_each_match_the_local_launcher(ray_cluster, capsys):
    on_ray = distributed(gpus=2, gpu_type="cpu", nnodes=2, init_process_group=True)(ddp_steps)
    results = on_ray.distributed(5, seed=3)
    out = capsys.readouterr().out

    assert [r["rank"] for r in results] == [0, 1]
    assert {r["world"] for r in results} == {2}
    assert sorted(r["node_rank"] for r in results) == [0, 1]
    worker_ids = {n.node_id for n in ray_cluster.worker_nodes}
    assert {r["ray_node"] for r in results} == worker_ids  # one rank on each Ray node
    assert results[0]["grads"] == results[1]["grads"]  # all-reduced
    assert results[0]["weights"] == results[1]["weights"]
    # Rank lines reach the caller prefixed with node and rank.
    for r in results:
        assert f"[node {r['node_rank']} rank {r['rank']}] node {r['node_rank']} final loss" in out
    table = ray.util.placement_group_table()
    assert table and all(pg["state"] == "REMOVED" for pg in table.values())

    local = distributed(gpus=2, gpu_type="cpu", init_process_group=True)(ddp_steps)
    expected = local.distributed(5, seed=3)
    assert [r["loss"] for r in results] == [r["loss"] for r in expected]
    assert results[0]["weights"] == expected[0]["weights"]


def fails_on_rank_1() -> None:
    if runtime.get_global_rank() == 1:
        raise ValueError("bad shard 7 (raised by the function)")


def test_a_rank_error_names_the_rank_and_its_node_and_is_not_retried(ray_cluster, tmp_path):
    fn = distributed(gpus=2, gpu_type="cpu", nnodes=2, max_restarts=1)(fails_on_rank_1)
    with pytest.raises(LaunchError, match=r"on node \d \(Ray node .*rank 1 failed.*bad shard 7"):
        fn.distributed()
    # An error raised by the code is not transient: no second gang was placed.
    assert len(list((trainflow_home() / "runs").iterdir())) == 2


@flow
def _ddp_subflow(workload: Workload, resources: Resources):
    return techniques["ddp"](workload=workload, technique=DDPConfig(), resources=resources)


def test_a_technique_subflow_runs_on_two_ray_nodes(ray_cluster, prefect_api, tmp_path):
    config = MLPConfig(max_steps=4, gpu_type="cpu", nnodes=2, retries=0, timeout_s=180)
    workload = Workload(
        train_fn=mlp.train,
        model_fn=mlp.build_model,
        config=config,
        output_dir=str(tmp_path / "out"),
        resume_from=str(tmp_path / "out" / "checkpoints"),
    )
    result = _ddp_subflow(workload, config.resources)
    assert result.steps == 4 and result.world_size == 2
    # Each node ran its own agent: one launch folder per node.
    specs = [json.loads(p.read_text()) for p in (trainflow_home() / "runs").glob("*/spec.json")]
    assert sorted(s["rdzv_is_host"] for s in specs) == [False, True]
    assert {s["nnodes"] for s in specs} == {2}
    # Rank lines reach the run's logs in Prefect, prefixed with node and rank.
    flush_prefect_logs()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(limit=200, sort=LogSort.TIMESTAMP_DESC)
    assert any(log.message.startswith("[node 0 rank 0] ") for log in logs)


def steps_with_checkpoints(folder: str, total: int) -> dict:
    """All-reduce once per step; rank 0 records the last finished step (the checkpoint)."""
    import torch
    import torch.distributed as dist

    ckpt = Path(folder) / "step.json"
    start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    for step in range(start, total):
        t = torch.ones(1)
        dist.all_reduce(t)
        if runtime.is_rank_zero():
            tmp = ckpt.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": step + 1, "world": int(t.item())}))
            tmp.replace(ckpt)
        runtime.heartbeat(step)
        if runtime.should_stop():  # asked to stop (a re-forming gang): the checkpoint is saved
            break
        time.sleep(0.3)
    return {"start": start, "world": runtime.get_world_size()}


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _rank_pids() -> list[int]:
    return [
        json.loads(p.read_text())["pid"]
        for p in (trainflow_home() / "runs").glob("*/ranks/rank_*.pid")
    ]


def _remove_a_worker_when(cluster, ckpt: Path, step: int) -> threading.Thread:
    def remove() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if json.loads(ckpt.read_text())["step"] >= step:
                    break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.1)
        cluster.remove_node(cluster.list_all_nodes()[-1], allow_graceful=False)

    thread = threading.Thread(target=remove, daemon=True)
    thread.start()
    return thread


def test_a_lost_node_ends_the_launch_naming_it_and_no_rank_waits(ray_cluster, tmp_path):
    fn = distributed(gpus=2, gpu_type="cpu", nnodes=2, init_process_group=True)(
        steps_with_checkpoints
    )
    thread = _remove_a_worker_when(ray_cluster, tmp_path / "step.json", 3)
    started = time.monotonic()
    try:
        with pytest.raises(NodeLostError, match=r"node \d \(Ray node \w+ .*\) was lost") as err:
            fn.distributed(str(tmp_path), 200)
        assert "other nodes' ranks were stopped" in str(err.value)
        assert time.monotonic() - started < 90
        thread.join(timeout=5)
        pids = _rank_pids()
        assert len(pids) == 2
        deadline = time.monotonic() + 10
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _running(p)], "ranks left running"
        table = ray.util.placement_group_table()
        assert all(pg["state"] == "REMOVED" for pg in table.values())
    finally:
        ray_cluster.add_node(num_cpus=1)
        ray_cluster.wait_for_nodes()


def test_an_elastic_range_starts_on_what_is_free_and_reforms_after_a_lost_node(
    ray_cluster, tmp_path
):
    fn = distributed(gpus=2, gpu_type="cpu", nnodes="1:2", max_restarts=1, init_process_group=True)(
        steps_with_checkpoints
    )
    thread = _remove_a_worker_when(ray_cluster, tmp_path / "step.json", 3)
    try:
        results = fn.distributed(str(tmp_path), 12)
        thread.join(timeout=5)
        # The second gang had one node left: it resumed from the checkpoint and finished.
        assert len(results) == 1
        assert results[0]["world"] == 1 and results[0]["start"] >= 3
        assert json.loads((tmp_path / "step.json").read_text()) == {"step": 12, "world": 1}
    finally:
        ray_cluster.add_node(num_cpus=1)
        ray_cluster.wait_for_nodes()


@ray.remote(num_cpus=1)
class _Holder:
    def ping(self) -> bool:
        return True


def test_an_elastic_range_takes_the_nodes_that_are_free(ray_cluster, tmp_path):
    holder = _Holder.remote()  # keeps one worker node's only CPU busy
    try:
        ray.get(holder.ping.remote(), timeout=60)
        fn = distributed(gpus=2, gpu_type="cpu", nnodes="1:2", init_process_group=True)(
            steps_with_checkpoints
        )
        results = fn.distributed(str(tmp_path), 2)
        assert [r["world"] for r in results] == [1]
    finally:
        ray.kill(holder)


def test_more_nodes_than_the_cluster_has_is_refused_naming_both(ray_cluster, monkeypatch):
    monkeypatch.setenv("TRAINFLOW_RAY_PLACEMENT_TIMEOUT", "2")
    fn = distributed(gpus=3, gpu_type="cpu", nnodes=3)(print)
    refused = r"could not reserve nnodes=3 node\(s\).*\(2 node\(s\) have room"
    with pytest.raises(LaunchError, match=refused):
        fn.distributed()
    assert not (trainflow_home() / "runs").exists()  # no rank started anywhere
    table = ray.util.placement_group_table()
    assert all(pg["state"] == "REMOVED" for pg in table.values())


def test_an_elastic_range_grows_when_a_node_frees_up_and_resumes(ray_cluster, tmp_path):
    holder = _Holder.remote()  # keeps one worker node busy: the run starts on one node
    ray.get(holder.ping.remote(), timeout=60)
    ckpt = tmp_path / "step.json"

    def free_the_node() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, ValueError):
                if json.loads(ckpt.read_text())["step"] >= 3:
                    break
            time.sleep(0.1)
        ray.kill(holder)

    thread = threading.Thread(target=free_the_node, daemon=True)
    thread.start()
    fn = distributed(gpus=2, gpu_type="cpu", nnodes="1:2", max_restarts=1, init_process_group=True)(
        steps_with_checkpoints
    )
    results = fn.distributed(str(tmp_path), 40)
    thread.join(timeout=5)
    # The first gang ran on one node; once the second was free it stopped at a checkpoint and
    # the gang re-formed on both, continuing from there.
    assert [r["world"] for r in results] == [2, 2]
    assert results[0]["start"] >= 3
    assert json.loads(ckpt.read_text()) == {"step": 40, "world": 2}


DRIVER = """
import time

from trainflow import distributed, runtime


def work():
    import torch
    import torch.distributed as dist

    for step in range(100000):
        t = torch.ones(1)
        dist.all_reduce(t)
        runtime.heartbeat(step)
        if runtime.should_stop():
            print(f"stopping at step {step}", flush=True)
            return step
        time.sleep(0.1)


fn = distributed(gpus=2, gpu_type="cpu", nnodes=2, init_process_group=True, stop_grace=20)(work)
fn.distributed()
"""


def test_ctrl_c_on_the_driver_stops_every_node_at_a_step_and_releases_the_gang(
    ray_cluster, tmp_path
):
    import signal
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    home = tmp_path / "trainflow-home"
    env = {**os.environ, "TRAINFLOW_HOME": str(home), "RAY_ADDRESS": ray_cluster.address}
    driver = subprocess.Popen(
        [sys.executable, str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(driver.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while len(list(home.glob("runs/*/ranks/rank_*.pid"))) < 2:
            assert driver.poll() is None, "".join(seen)
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.2)
        time.sleep(2)  # a few steps in
        pids = [json.loads(p.read_text())["pid"] for p in home.glob("runs/*/ranks/rank_*.pid")]
        os.killpg(driver.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        driver.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    out = "".join(seen)
    assert driver.returncode != 0
    assert "KeyboardInterrupt" in out
    # Both nodes' ranks agreed on a step, stopped there, and are gone.
    assert "[node 0 rank 0] stopping at step" in out and "[node 1 rank 1] stopping at step" in out
    deadline = time.monotonic() + 10
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _running(p)], [psutil.Process(p).status() for p in pids]
    if not ray.is_initialized():
        ray.init(address=ray_cluster.address)
    table = ray.util.placement_group_table()
    assert table and all(pg["state"] == "REMOVED" for pg in table.values())
