"""Ctrl-C on a framework run: the ranks in the framework's own environment stop with it.

`python -m flows.axolotl` runs in its own session, as a terminal's foreground job does; once
Axolotl logs training steps on rank 0, the whole process group gets SIGINT, as a terminal
sends it. What must be left: no process (the ranks run another interpreter, and Axolotl
starts dataset workers of its own), the MLflow run KILLED, nothing registered.
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests import processes
from tests.flows.test_stop_signals import _only_run, _start_pipeline
from trainflow.configs.frameworks import FRAMEWORKS

pytestmark = pytest.mark.slow

LONG = {"max_steps": 100000, "registered_model_name": "axolotl-stopped"}


def _training(home: Path) -> bool:
    return any(
        "'loss':" in p.read_text(errors="replace") for p in home.glob("runs/*/logs/rank_0.log")
    )


def test_ctrl_c_stops_every_process_of_a_framework_run(tmp_path):
    python = FRAMEWORKS["axolotl"].default_python()
    if not python.exists():
        pytest.skip(f"{python} missing: `bash scripts/setup-framework.sh axolotl` makes it")
    home = Path(os.environ["TRAINFLOW_HOME"])
    out = tmp_path / "out.txt"
    proc = _start_pipeline(tmp_path / "prefect-home", out, "axolotl", LONG)
    procs: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while not _training(home):
            assert proc.poll() is None, f"exited {proc.returncode}:\n{out.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no training step:\n{out.read_text()[-4000:]}"
            time.sleep(0.2)
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
        ranks = [p for p in procs if p.cmdline() and p.cmdline()[0] == str(python)]
        assert len(ranks) >= 3, [p.cmdline() for p in procs]  # the agent and two ranks
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 30 s after SIGINT:\n{out.read_text()[-4000:]}")
        survivors = processes.survivors(procs, 10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        processes.kill_all(procs)
    text = out.read_text()
    assert proc.returncode == 130, text[-4000:]
    assert survivors == [], [(p.pid, p.cmdline()) for p in survivors]
    client, run = _only_run("frameworks")
    assert run.info.status == "KILLED", text[-4000:]
    assert client.search_model_versions("name='axolotl-stopped'") == []
    assert f"stopped: Ctrl-C (SIGINT); MLflow run {run.info.run_id} is KILLED" in text
