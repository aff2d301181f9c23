"""Stopping a launch cleanly: Ctrl-C in the caller, SIGTERM to the ranks (a preemption).

Ranks get the stop as a flag, agree on the step to stop at (`runtime.should_stop()`), and end;
whatever ignores the stop is killed after `stop_grace`. Real processes and real signals.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO_ROOT
from trainflow import RankError, distributed, runtime
from trainflow.errors import Preempted, StopRequested, is_transient

CALLER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from trainflow import distributed, runtime

    out, mode, stop_grace = sys.argv[1], sys.argv[2], float(sys.argv[3])

    @distributed(gpus=2, gpu_type="cpu", init_process_group=True, stop_grace=stop_grace)
    def train(out, mode):
        rank = runtime.get_global_rank()
        Path(out, f"pid_{rank}").write_text(str(os.getpid()))
        step = 0
        while True:
            step += 1
            runtime.heartbeat(step)
            Path(out, f"step_{rank}").write_text(str(step))
            if mode == "ignore" and step == 3:
                time.sleep(600)  # a step that never ends: the stop request goes unseen
            time.sleep(0.05)
            if runtime.should_stop():
                Path(out, f"stopped_{rank}").write_text(str(step))
                return step

    train.distributed(out, mode)
    """
)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(condition, seconds: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"caller exited early: {proc.stderr.read().decode()}")
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(folder.glob("pid_*"))]


def _assert_no_survivors(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [p for p in pids if _alive(p)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert survivors == []


def _steps_reached(folder: Path, at_least: int) -> bool:
    steps = [p.read_text() for p in folder.glob("step_*")]
    return len(steps) == 2 and all(s.isdigit() and int(s) >= at_least for s in steps)


def _start_caller(tmp_path: Path, mode: str, stop_grace: float) -> subprocess.Popen:
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), mode, str(stop_grace)],
        cwd=REPO_ROOT,
        env=os.environ.copy(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )


def test_ctrl_c_lets_every_rank_stop_at_the_same_step(tmp_path):
    caller = _start_caller(tmp_path, "loop", stop_grace=30)
    try:
        _wait_for(lambda: _steps_reached(tmp_path, 3), 90, "ranks did not start", caller)
        pids = _pids(tmp_path)
        os.killpg(caller.pid, signal.SIGINT)  # Ctrl-C
        sent = time.monotonic()
        caller.wait(timeout=30)
        elapsed = time.monotonic() - sent
    finally:
        if caller.poll() is None:
            os.killpg(caller.pid, signal.SIGKILL)
    stopped = {p.name: p.read_text() for p in tmp_path.glob("stopped_*")}
    assert set(stopped) == {"stopped_0", "stopped_1"}
    assert stopped["stopped_0"] == stopped["stopped_1"]  # they agreed on the step
    assert b"KeyboardInterrupt" in caller.stderr.read()
    # Ranks that stopped end the wait early, long before the 30 s grace.
    assert elapsed < 15, f"caller took {elapsed:.1f}s to stop"
    _assert_no_survivors(pids)


def test_ranks_ignoring_the_stop_are_killed_after_stop_grace(tmp_path):
    caller = _start_caller(tmp_path, "ignore", stop_grace=3)
    try:
        _wait_for(lambda: _steps_reached(tmp_path, 3), 90, "ranks did not start", caller)
        pids = _pids(tmp_path)
        os.killpg(caller.pid, signal.SIGINT)
        sent = time.monotonic()
        caller.wait(timeout=30)
        elapsed = time.monotonic() - sent
    finally:
        if caller.poll() is None:
            os.killpg(caller.pid, signal.SIGKILL)
    assert b"KeyboardInterrupt" in caller.stderr.read()
    assert 2.5 < elapsed < 3 + 8, f"caller took {elapsed:.1f}s to stop"
    _assert_no_survivors(pids)


def test_second_ctrl_c_kills_at_once(tmp_path):
    caller = _start_caller(tmp_path, "ignore", stop_grace=120)
    try:
        _wait_for(lambda: _steps_reached(tmp_path, 3), 90, "ranks did not start", caller)
        pids = _pids(tmp_path)
        os.killpg(caller.pid, signal.SIGINT)
        time.sleep(1)
        assert caller.poll() is None  # waiting for the ranks
        os.killpg(caller.pid, signal.SIGINT)
        sent = time.monotonic()
        caller.wait(timeout=30)
        elapsed = time.monotonic() - sent
    finally:
        if caller.poll() is None:
            os.killpg(caller.pid, signal.SIGKILL)
    assert elapsed < 10, f"caller took {elapsed:.1f}s after the second Ctrl-C"
    _assert_no_survivors(pids)


@distributed(gpus=2, gpu_type="cpu", timeout=120, init_process_group=True)
def train_until_preempted(out: str) -> None:
    rank = runtime.get_global_rank()
    Path(out, f"pid_{rank}").write_text(str(os.getpid()))
    step = 0
    while True:
        step += 1
        runtime.heartbeat(step)
        Path(out, f"step_{rank}").write_text(str(step))
        time.sleep(0.05)
        if runtime.should_stop():
            Path(out, f"stopped_{rank}").write_text(f"{step} {runtime.stop_requested()}")
            raise Preempted(rank=rank, step=step)  # after its final checkpoint


@pytest.mark.parametrize("targets", ["every rank", "rank 1 only", "the agent"])
def test_sigterm_to_ranks_is_a_preemption_every_rank_agrees_on(tmp_path, targets):
    """SIGTERM straight to the ranks, as a node shutdown sends it, or to the elastic agent,
    which forwards it; the caller is not told."""

    def preempt() -> None:
        _wait_for(lambda: _steps_reached(tmp_path, 3), 90, "ranks did not start")
        pids = _pids(tmp_path)
        if targets == "the agent":
            pids = [psutil.Process(pids[0]).ppid()]
        elif targets == "rank 1 only":
            pids = pids[1:]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)

    thread = threading.Thread(target=preempt, daemon=True)
    thread.start()
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        train_until_preempted.distributed(str(tmp_path))
    elapsed = time.monotonic() - start
    thread.join(timeout=5)
    err = info.value
    assert err.exc_type.endswith("Preempted") and is_transient(err)
    assert isinstance(err.__cause__, Preempted)
    stopped = {p.name: p.read_text().split() for p in tmp_path.glob("stopped_*")}
    assert set(stopped) == {"stopped_0", "stopped_1"}
    assert stopped["stopped_0"][0] == stopped["stopped_1"][0]  # the same step
    # Only the signalled ranks got the request themselves; the others learnt it by agreement.
    got_sigterm = {0: targets != "rank 1 only", 1: True}
    assert {r: stopped[f"stopped_{r}"][1] for r in (0, 1)} == {
        r: str(flag) for r, flag in got_sigterm.items()
    }
    assert elapsed < 60
    _assert_no_survivors(_pids(tmp_path))


@distributed(gpus=2, gpu_type="cpu", timeout=120, max_restarts=1)
def first_attempt_fails_while_rank_0_sleeps() -> int:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0:
        if runtime.get_global_rank() == 1:
            raise RuntimeError("transient failure")
        time.sleep(600)  # not in a collective: it never notices on its own
    return attempt


def test_survivors_of_a_failed_attempt_are_stopped_at_once_for_the_restart():
    """They only note the agent's SIGTERM; left to the agent, the restart waits 30 s."""
    start = time.monotonic()
    assert first_attempt_fails_while_rank_0_sleeps.distributed() == [1, 1]
    elapsed = time.monotonic() - start
    assert elapsed < 25, f"took {elapsed:.0f}s"


def test_stop_file_stops_the_launch_as_a_preemption_that_is_not_retried(tmp_path):
    """Another process creates the launch's stop file (a sweep's pruner, a person): every rank
    stops at the same step, and the launch raises `StopRequested`, which is not transient."""
    stop_file = tmp_path / "STOP"
    launch = distributed(
        gpus=2, gpu_type="cpu", timeout=120, init_process_group=True, stop_file=str(stop_file)
    )(train_until_preempted.fn)

    def request() -> None:
        _wait_for(lambda: _steps_reached(tmp_path, 3), 90, "ranks did not start")
        stop_file.touch()

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    start = time.monotonic()
    with pytest.raises(StopRequested) as info:
        launch.distributed(str(tmp_path))
    elapsed = time.monotonic() - start
    thread.join(timeout=5)
    assert not is_transient(info.value) and str(stop_file) in str(info.value)
    stopped = {p.name: p.read_text().split() for p in tmp_path.glob("stopped_*")}
    assert set(stopped) == {"stopped_0", "stopped_1"}
    assert stopped["stopped_0"][0] == stopped["stopped_1"][0]  # the same step
    assert elapsed < 60
    _assert_no_survivors(_pids(tmp_path))


@distributed(gpus=2, gpu_type="cpu", timeout=120, init_process_group=True)
def stop_asked_on_rank_1(step_s: float, ask_at: int) -> int:
    """Train steps of `step_s`; rank 1 alone is asked to stop at the end of step `ask_at`.
    Returns the step this rank stopped at."""
    rank = runtime.get_global_rank()
    for step in range(1, 100):
        time.sleep(step_s)
        if rank == 1 and step == ask_at:
            runtime.request_stop()
        if runtime.should_stop():
            return step
    return -1


def test_ranks_agree_on_the_stop_step_with_spaced_checks_beside_short_steps():
    """Short steps are checked about every `STOP_CHECK_EVERY_S` seconds, each check left in
    flight and read a step later: every rank still stops at the same step, soon after the
    request."""
    step_s, ask_at = 0.01, 5
    stops = stop_asked_on_rank_1.distributed(step_s, ask_at)
    assert stops[0] == stops[1]
    # The first two checks wait (no step measured yet); the next comes about
    # STOP_CHECK_EVERY_S later and is read one step after that.
    spacing = int(runtime.STOP_CHECK_EVERY_S / step_s)
    assert ask_at < stops[0] <= 2 + spacing + 1, stops


def test_ranks_stop_at_once_when_steps_are_long():
    """Steps longer than `STOP_CHECK_WAIT_STEP_S` wait for their own check, every step."""
    assert stop_asked_on_rank_1.distributed(runtime.STOP_CHECK_WAIT_STEP_S + 0.05, 5) == [5, 5]
