"""Follower nodes: the leader runs the program, `python -m trainflow.launch.follower` runs the rest.

Two processes on this machine stand in for pod 0 and pod 1 of the Kubernetes Indexed Job: a
leader script (`JOB_COMPLETION_INDEX=0`) that calls a two-node function, and a follower
(`JOB_COMPLETION_INDEX=1`) that runs nothing but its node's share of each launch. Both get the
same rendezvous endpoint, run id and launch board, as the job template gives every pod. The
ranks are real gloo ranks of real elastic agents on each side.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO_ROOT, free_port
from trainflow.errors import LaunchConfigError
from trainflow.launch.board import BOARD_ENV, NODE_INDEX_ENV, board_address, board_enabled
from trainflow.launch.spec import AGENT_PID_ENV
from trainflow.runtime import RUN_DIR_ENV

LEADER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from trainflow import distributed, runtime

    OUT = Path(sys.argv[1])

    @distributed(gpus=2, gpu_type="cpu", nnodes=2, init_process_group=True, timeout=90)
    def step(tag):
        index = os.environ.get("JOB_COMPLETION_INDEX")
        info = {
            "tag": tag,
            "index": index,
            "rank": dist.get_rank(),
            "node_rank": runtime.get_node_rank(),
            "world": dist.get_world_size(),
            "pid": os.getpid(),
            "agent": os.getppid(),
        }
        if tag == "bad" and index == "1":
            (OUT / f"{tag}-{index}.json").write_text(json.dumps(info))
            raise ValueError("bad shard")
        if tag == "hang":
            (OUT / f"{tag}-{index}.json").write_text(json.dumps(info))
            time.sleep(600)
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        info["sum"] = t.item()
        (OUT / f"{tag}-{index}.json").write_text(json.dumps(info))
        print(f"hello from {tag}", flush=True)
        return info

    results = {}
    for tag in sys.argv[2:]:
        try:
            results[tag] = step.distributed(tag)
        except Exception as exc:
            results[tag] = {"error": type(exc).__name__, "message": str(exc)}
    (OUT / "leader.json").write_text(json.dumps(results))
    """
)


def _env(index: int, board: str, rdzv: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "JOB_COMPLETION_INDEX": str(index),
        "TRAINFLOW_LAUNCH_BOARD": board,
        "TRAINFLOW_RDZV_ENDPOINT": rdzv,
        "TRAINFLOW_RUN_ID": "follow-test",
        "TRAINFLOW_FOLLOW_TIMEOUT": "60",
    }


class _Nodes:
    """A leader script and a follower process, with their output in files."""

    def __init__(self, tmp_path: Path, *tags: str):
        self.out = tmp_path / "out"
        self.out.mkdir()
        script = tmp_path / "leader.py"
        script.write_text(LEADER)
        board, rdzv = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.files = {  # closed in close()
            name: open(tmp_path / f"{name}.out", "wb")  # noqa: SIM115
            for name in ("leader", "follower")
        }
        self.follower = subprocess.Popen(
            [sys.executable, "-m", "trainflow.launch.follower"],
            cwd=REPO_ROOT,
            env=_env(1, board, rdzv),
            stdout=self.files["follower"],
            stderr=subprocess.STDOUT,
        )
        self.leader = subprocess.Popen(
            [sys.executable, str(script), str(self.out), *tags],
            cwd=tmp_path,
            env=_env(0, board, rdzv),
            stdout=self.files["leader"],
            stderr=subprocess.STDOUT,
        )
        self.tmp_path = tmp_path

    def text(self, name: str) -> str:
        return (self.tmp_path / f"{name}.out").read_text(errors="replace")

    def rank(self, tag: str, index: int) -> dict:
        return json.loads((self.out / f"{tag}-{index}.json").read_text())

    def wait(self, proc: subprocess.Popen, seconds: float) -> int:
        try:
            return proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running after {seconds}s\n--- leader ---\n{self.text('leader')}"
                f"\n--- follower ---\n{self.text('follower')}"
            ) from None

    def close(self) -> None:
        for proc in (self.leader, self.follower):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in self.files.values():
            f.close()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _left(pids: set[int], seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return sorted(p for p in pids if _alive(p))


def test_the_follower_runs_its_share_of_every_launch_and_exits_with_the_leader(tmp_path):
    nodes = _Nodes(tmp_path, "one", "two")
    try:
        assert nodes.wait(nodes.leader, 120) == 0, nodes.text("leader")
        assert nodes.wait(nodes.follower, 30) == 0, nodes.text("follower")
        results = json.loads((nodes.out / "leader.json").read_text())
        pids = set()
        for tag in ("one", "two"):
            # The leader's call returns its own node's ranks, after an all-reduce over both.
            (mine,) = results[tag]
            theirs = nodes.rank(tag, 1)
            assert mine == nodes.rank(tag, 0)
            assert mine["index"] == "0" and theirs["index"] == "1"
            assert mine["world"] == theirs["world"] == 2
            assert mine["sum"] == theirs["sum"] == 3.0  # (rank 0 + 1) + (rank 1 + 1)
            assert {mine["rank"], theirs["rank"]} == {0, 1}
            assert {mine["node_rank"], theirs["node_rank"]} == {0, 1}
            pids |= {mine["pid"], mine["agent"], theirs["pid"], theirs["agent"]}
            # The follower's rank lines are its own, labelled by node and rank.
            label = f"[node {theirs['node_rank']} rank {theirs['rank']}] hello from {tag}"
            assert label in nodes.text("follower")
            assert f"hello from {tag}" in nodes.text("leader")
        assert len(pids) == 8
        assert _left(pids) == []
    finally:
        nodes.close()


def test_a_follower_rank_error_is_the_leaders_error_and_the_follower_stays(tmp_path):
    nodes = _Nodes(tmp_path, "bad", "after")
    try:
        assert nodes.wait(nodes.leader, 120) == 0, nodes.text("leader")
        assert nodes.wait(nodes.follower, 30) == 0, nodes.text("follower")
        results = json.loads((nodes.out / "leader.json").read_text())
        bad = nodes.rank("bad", 1)
        # The follower rank's own error is the cause, not the leader rank's broken collective.
        assert results["bad"]["error"] == "RankError", results["bad"]
        first = results["bad"]["message"].splitlines()[0]
        assert first.startswith("on follower node 1 (JOB_COMPLETION_INDEX=1): "), first
        assert f"rank {bad['rank']} failed" in first and "ValueError: bad shard" in first
        assert 'raise ValueError("bad shard")' in results["bad"]["message"]  # its traceback
        # The follower served the next launch as well.
        (mine,) = results["after"]
        assert mine["sum"] == nodes.rank("after", 1)["sum"] == 3.0
        pids = {bad["pid"], bad["agent"], mine["pid"], mine["agent"]}
        pids |= {nodes.rank("after", 1)["pid"], nodes.rank("after", 1)["agent"]}
        assert _left(pids) == []
    finally:
        nodes.close()


def test_a_lost_leader_ends_the_follower_and_its_ranks(tmp_path):
    nodes = _Nodes(tmp_path, "hang")
    try:
        deadline = time.monotonic() + 90
        while not all((nodes.out / f"hang-{i}.json").exists() for i in (0, 1)):
            assert nodes.leader.poll() is None, nodes.text("leader")
            assert nodes.follower.poll() is None, nodes.text("follower")
            assert time.monotonic() < deadline, nodes.text("follower")
            time.sleep(0.1)
        time.sleep(0.3)
        ranks = [nodes.rank("hang", i) for i in (0, 1)]
        pids = {p for r in ranks for p in (r["pid"], r["agent"])}
        assert all(_alive(p) for p in pids)
        nodes.leader.send_signal(signal.SIGKILL)
        assert nodes.wait(nodes.follower, 30) == 1
        out = nodes.text("follower").splitlines()
        (error,) = [
            line for line in out if line.startswith("python -m trainflow.launch.follower: error")
        ]
        assert "went away" in error and "the leader (node 0) ended abnormally" in error, error
        assert "frame #" not in nodes.text("follower")  # no C++ trace from the store client
        assert _left(pids) == []
    finally:
        nodes.close()


def test_a_follower_without_a_leader_gives_up_with_one_clear_line(tmp_path):
    port = free_port()
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "trainflow.launch.follower"],
        cwd=REPO_ROOT,
        env={
            **_env(1, f"127.0.0.1:{port}", "127.0.0.1:1"),
            "TRAINFLOW_FOLLOW_TIMEOUT": "1",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - started
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        f"python -m trainflow.launch.follower: error: no launch board at 127.0.0.1:{port} after 1s "
        "(TRAINFLOW_FOLLOW_TIMEOUT; last error: "
    ), line
    assert "Connection refused" in line
    assert line.endswith("is the leader (node 0) running, with TRAINFLOW_LAUNCH_BOARD set alike?")
    assert done.stdout == ""
    assert took < 30


def test_only_the_leader_hosts_the_board(monkeypatch):
    monkeypatch.delenv(AGENT_PID_ENV, raising=False)
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    monkeypatch.delenv(NODE_INDEX_ENV, raising=False)
    monkeypatch.delenv(BOARD_ENV, raising=False)
    assert not board_enabled()
    monkeypatch.setenv(BOARD_ENV, "pod-0.rdzv.ns.svc.cluster.local:29401")
    assert board_enabled()  # no index: a single program that leads
    monkeypatch.setenv(NODE_INDEX_ENV, "0")
    assert board_enabled()
    monkeypatch.setenv(NODE_INDEX_ENV, "1")
    assert not board_enabled()
    monkeypatch.setenv(NODE_INDEX_ENV, "0")
    monkeypatch.setenv(AGENT_PID_ENV, "123")  # an agent or rank of the leader's launch
    assert not board_enabled()
    assert board_address("pod-0.rdzv.ns.svc.cluster.local:29401") == (
        "pod-0.rdzv.ns.svc.cluster.local",
        29401,
    )
    assert board_address("[::1]:29401") == ("::1", 29401)
    for bad in ("pod-0", "pod-0:", ":29401", "pod-0:http", "pod-0:70000"):
        with pytest.raises(LaunchConfigError, match=BOARD_ENV):
            board_address(bad)
