"""No process of a launch outlives its caller: Ctrl-C, or the caller killed outright."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO_ROOT

CALLER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from pathlib import Path
    from trainflow import distributed, runtime

    @distributed(gpus=2, gpu_type="cpu")
    def hang(pid_dir):
        rank = runtime.get_global_rank()
        child = subprocess.Popen(["sleep", "600"], start_new_session=True)
        Path(pid_dir, f"grandchild_{rank}").write_text(str(child.pid))
        Path(pid_dir, f"pid_{rank}").write_text(str(os.getpid()))
        time.sleep(600)

    hang.distributed(sys.argv[1])
    """
)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _start_caller(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    caller = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        cwd=REPO_ROOT,
        env=os.environ.copy(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 90
    while len(list(tmp_path.glob("pid_*"))) < 2:
        assert caller.poll() is None, caller.stderr.read().decode()
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.2)
    time.sleep(0.3)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid_*")]
    return caller, pids + [int(p.read_text()) for p in tmp_path.glob("grandchild_*")]


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "sigterm", "kill-9"]
)
def test_stopping_the_caller_stops_every_rank_and_what_ranks_started(tmp_path, sig):
    """Ranks and the processes they started in their own sessions all end; the pickled
    function and arguments are removed even when the caller could not do it (SIGKILL)."""
    caller, pids = _start_caller(tmp_path)
    assert len(pids) == 4 and all(_alive(p) for p in pids)
    caller.send_signal(sig)
    caller.wait(timeout=30)
    survivors = _wait_gone(pids, 15)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert survivors == []
    if sig == signal.SIGINT:
        assert b"KeyboardInterrupt" in caller.stderr.read()
    runs = Path(os.environ["TRAINFLOW_HOME"]) / "runs"
    assert len(list(runs.glob("*/spec.json"))) == 1
    assert list(runs.glob("*/payload.pkl")) == [], "the payload outlived the launch"


@pytest.mark.parametrize("ending", ["return", "raise", "timeout"])
def test_a_process_a_rank_starts_in_its_own_session_ends_with_the_launch(tmp_path, ending):
    """What a build tool does with a compiler, or a user with `start_new_session=True`: out of
    reach of a group kill, and it would be re-parented to init. The agent adopts it
    (subreaper) and stops it when the launch ends, however the function ended."""
    from trainflow import LaunchTimeoutError, RankError, distributed, runtime

    @distributed(gpus=2, gpu_type="cpu", timeout=120 if ending != "timeout" else 15)
    def start_a_daemon(folder: str, ending: str) -> int:
        child = subprocess.Popen(["sleep", "120"], start_new_session=True)
        Path(folder, f"grandchild_{runtime.get_global_rank()}").write_text(str(child.pid))
        if ending == "raise":
            raise ValueError("the function failed after starting a process")
        if ending == "timeout":
            time.sleep(120)
        return child.pid

    if ending == "return":
        start_a_daemon.distributed(str(tmp_path), ending)
    else:
        error = RankError if ending == "raise" else LaunchTimeoutError
        with pytest.raises(error, match="the function failed|timed out"):
            start_a_daemon.distributed(str(tmp_path), ending)
    pids = [int(p.read_text()) for p in tmp_path.glob("grandchild_*")]
    assert pids, "the ranks did not start their processes"
    assert _wait_gone(pids, 10) == [], "a process a rank started outlived the launch"


def test_streaming_shared_memory_is_released_by_forked_ranks(tmp_path, capfd):
    """Forked ranks end in `os._exit`; the launch still runs their exit handlers, so streaming
    unlinks its shared memory itself and the resource tracker finds nothing leaked."""
    from streaming import MDSWriter, StreamingDataset

    from trainflow import distributed

    with MDSWriter(out=str(tmp_path / "mds"), columns={"x": "int"}) as writer:
        for i in range(64):
            writer.write({"x": i})

    @distributed(gpus=2, gpu_type="cpu", init_process_group=True)
    def count(path: str) -> tuple[int, int]:
        dataset = StreamingDataset(local=path, batch_size=4, shuffle=False)
        return sum(1 for _ in dataset), dataset._shm_prefix_int

    (n0, prefix), (n1, prefix1) = count.distributed(str(tmp_path / "mds"))
    assert (n0, n1) == (32, 32)
    assert prefix1 == prefix
    out, err = capfd.readouterr()
    assert "leaked" not in out + err, out + err
    # Streaming names its shared memory after the dataset's prefix; other runs may hold theirs.
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"{prefix:06d}_")] == []
