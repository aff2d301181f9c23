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
    import os, sys, time
    from pathlib import Path
    from trainflow import distributed, runtime

    @distributed(gpus=2, gpu_type="cpu")
    def hang(pid_dir):
        Path(pid_dir, f"pid_{runtime.get_global_rank()}").write_text(str(os.getpid()))
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
    return caller, [int(p.read_text()) for p in tmp_path.glob("pid_*")]


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_stopping_the_caller_stops_every_rank(tmp_path, sig):
    caller, pids = _start_caller(tmp_path)
    assert all(_alive(p) for p in pids)
    caller.send_signal(sig)
    caller.wait(timeout=30)
    survivors = _wait_gone(pids, 15)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert survivors == []
    if sig == signal.SIGINT:
        assert b"KeyboardInterrupt" in caller.stderr.read()
