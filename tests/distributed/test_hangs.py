"""Hung and silent ranks: the launch names them, shows where they are stuck, and stops them.

Real 2-rank launches (gloo on CPU); plus the retry classification of launch errors.
"""

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from trainflow import LaunchOptions, distributed, runtime
from trainflow.errors import (
    HangError,
    LaunchConfigError,
    LaunchError,
    LaunchTimeoutError,
    PayloadError,
    Preempted,
    RankError,
    is_transient,
)
from trainflow.launch.run_dir import RunDir


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(folder.glob("pid_*"))]


def _assert_no_survivors(folder: Path) -> None:
    pids = _pids(folder)
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [p for p in pids if _alive(p)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert survivors == []


@distributed(gpus=2, gpu_type="cpu", timeout=120, init_process_group=True, collective_timeout=5)
def rank_one_sleeps_at_step_3(pid_dir: str) -> None:
    rank = runtime.get_global_rank()
    Path(pid_dir, f"pid_{rank}").write_text(str(os.getpid()))
    for step in range(1, 1000):
        runtime.heartbeat(step)
        if rank == 1 and step == 3:
            time.sleep(600)  # never joins the all-reduce below
        dist.all_reduce(torch.ones(1))


def test_rank_silent_in_a_collective_is_named_with_its_stack(tmp_path):
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        rank_one_sleeps_at_step_3.distributed(str(tmp_path))
    elapsed = time.monotonic() - start
    err, text = info.value, str(info.value)
    assert err.stuck_ranks == [1] and err.last_steps == {1: 3}
    assert "rank 1 stopped answering: rank 0 timed out after 5s waiting for it" in text
    assert "Stack of rank 1 (last step 3)" in text
    assert "in rank_one_sleeps_at_step_3" in text and "time.sleep(600)" in text
    assert "Traceback from rank 0" in text
    assert is_transient(err)
    assert elapsed < 40, f"took {elapsed:.0f}s"
    _assert_no_survivors(tmp_path)


@distributed(gpus=2, gpu_type="cpu", timeout=120, init_process_group=True, collective_timeout=30)
def rank_one_is_killed_at_step_3(pid_dir: str) -> None:
    rank = runtime.get_global_rank()
    Path(pid_dir, f"pid_{rank}").write_text(str(os.getpid()))
    for step in range(1, 1000):
        runtime.heartbeat(step)
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
        dist.all_reduce(torch.ones(1))


def test_peer_killed_during_a_collective_is_named_as_dead(tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        rank_one_is_killed_at_step_3.distributed(str(tmp_path))
    elapsed = time.monotonic() - start
    err = info.value
    assert not isinstance(err, (RankError, HangError))
    assert "rank 1 died without a Python error" in str(err)
    assert "rank 0 then failed in a collective" in str(err)
    assert is_transient(err)
    assert elapsed < 40, f"took {elapsed:.0f}s"  # well before the 30 s collective timeout ends
    _assert_no_survivors(tmp_path)


# The line NCCL's watchdog logs before it aborts a rank whose collective timed out.
NCCL_TIMEOUT_LINE = (
    "[rank0]:[E1201 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=4, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=5000) "
    "ran for 5001 milliseconds before timing out."
)


@distributed(gpus=2, gpu_type="cpu", timeout=120)
def rank_zero_aborts_like_nccl(pid_dir: str) -> None:
    rank = runtime.get_global_rank()
    Path(pid_dir, f"pid_{rank}").write_text(str(os.getpid()))
    for step in range(1, 4):
        runtime.heartbeat(step)
    if rank == 0:
        time.sleep(1)
        print(NCCL_TIMEOUT_LINE, file=sys.stderr, flush=True)
        os.abort()  # no Python error: what the watchdog does
    time.sleep(600)


def test_rank_aborted_by_the_nccl_watchdog_names_its_silent_peer(tmp_path):
    """CPU stand-in for NCCL: the aborted rank leaves only the watchdog's line in its log."""
    with pytest.raises(HangError) as info:
        rank_zero_aborts_like_nccl.distributed(str(tmp_path))
    err, text = info.value, str(info.value)
    assert err.stuck_ranks == [1] and err.last_steps == {1: 3}
    assert "rank 1 stopped answering: rank 0 timed out after 5s waiting for it" in text
    assert "in rank_zero_aborts_like_nccl" in text and "time.sleep(600)" in text
    assert "Last lines of rank 0" in text and "Watchdog caught" in text
    _assert_no_survivors(tmp_path)


@distributed(gpus=2, gpu_type="cpu", timeout=120, hang_timeout=4)
def both_stall_after_step_3(pid_dir: str) -> None:
    Path(pid_dir, f"pid_{runtime.get_global_rank()}").write_text(str(os.getpid()))
    for step in range(1, 4):
        runtime.heartbeat(step)
        time.sleep(0.1)
    time.sleep(600)


def test_watchdog_stops_a_launch_whose_heartbeats_stopped(tmp_path):
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        both_stall_after_step_3.distributed(str(tmp_path))
    elapsed = time.monotonic() - start
    err, text = info.value, str(info.value)
    assert err.stuck_ranks == [0, 1] and err.last_steps == {0: 3, 1: 3}
    assert "no rank's heartbeat advanced for 4s" in text
    assert "rank 0 at step 3" in text and "rank 1 at step 3" in text
    assert "Stack of rank 0 (last step 3)" in text and "Stack of rank 1 (last step 3)" in text
    assert "in both_stall_after_step_3" in text and "time.sleep(600)" in text
    assert is_transient(err)
    assert elapsed < 40, f"took {elapsed:.0f}s"
    _assert_no_survivors(tmp_path)


def test_heartbeats_are_read_back_and_torn_records_skipped(tmp_path):
    rd = RunDir(tmp_path)
    rd.ranks.mkdir()
    beat = rd.heartbeat(3)
    beat.beat(41, attempt=1)
    beat.beat(42, attempt=1)
    got = rd.heartbeats()[3]
    assert (got["step"], got["attempt"]) == (42, 1) and abs(got["time"] - time.time()) < 60
    whole = (rd.ranks / "rank_3.beat").read_bytes()
    torn = whole[:10] + b"9" + whole[11:]  # a reader caught a new step half-written
    for data in (torn, whole[:-5], b""):
        (rd.ranks / "rank_3.beat").write_bytes(data)
        assert rd.heartbeats() == {}


def test_heartbeat_and_stop_checks_outside_a_launch_do_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv(runtime.RUN_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    runtime.heartbeat(1)
    assert list(tmp_path.iterdir()) == []
    assert runtime.stop_requested() is False
    assert runtime.should_stop() is False


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("collective_timeout", 0),
        ("collective_timeout", float("inf")),
        ("hang_timeout", -1),
        ("hang_timeout", "5"),
        ("stop_grace", -0.5),
        ("stop_grace", True),
    ],
)
def test_launch_options_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        LaunchOptions(gpus=2, **{field: value})


def test_launch_options_defaults():
    opts = LaunchOptions(gpus=2, stop_grace=0)
    assert (opts.collective_timeout, opts.hang_timeout, opts.stop_grace) == (600.0, None, 0)


def _rank_error(exc_type: str, message: str) -> RankError:
    return RankError(
        f"rank 0 failed while running the function with {exc_type.rsplit('.', 1)[-1]}: "
        f"{message}\n\nTraceback from rank 0:\n...",
        rank=0,
        exc_type=exc_type,
        remote_traceback="...",
        failed_ranks=[0],
        remote_message=message,
    )


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (LaunchTimeoutError("timed out", running_ranks=[0]), True),
        (HangError("hung", stuck_ranks=[1]), True),
        (LaunchError("rank 0 died: Signal 9 (SIGKILL)"), True),
        (_rank_error("torch.distributed.DistBackendError", "NCCL communicator was aborted"), True),
        (_rank_error("torch.distributed.DistNetworkError", "Connection reset by peer"), True),
        (_rank_error("torch.distributed.DistStoreError", "wait timeout after 30000ms"), True),
        (_rank_error("trainflow.errors.Preempted", "rank 1 stopped on request after 7"), True),
        (_rank_error("builtins.RuntimeError", "[gloo] Connection closed by peer"), True),
        (_rank_error("builtins.RuntimeError", "Gloo: Timed out waiting 5000ms for recv"), True),
        (_rank_error("builtins.ValueError", "bad batch on rank one"), False),
        (_rank_error("builtins.RuntimeError", "CUDA error: device-side assert"), False),
        (_rank_error("builtins.TimeoutError", "my HTTP request timed out"), False),
        (_rank_error("mylib.DistBackendError", "not torch's"), False),
        (PayloadError("argument 'lock' cannot be sent"), False),
        (LaunchConfigError("TRAINFLOW_START_METHOD='x': use fork, spawn or forkserver"), False),
        (ValueError("learning rate must be positive"), False),
        (KeyboardInterrupt(), False),
        (Preempted(rank=0, step=3), True),  # raised in-process, not through a launch
    ],
)
def test_is_transient(exc, transient):
    assert is_transient(exc) is transient


def test_launch_errors_survive_pickling():
    import pickle

    errors = [
        _rank_error("trainflow.errors.Preempted", "rank 1 stopped on request after step 7"),
        HangError("hung", stuck_ranks=[1], last_steps={1: 3}, log_dir="/logs"),
        LaunchTimeoutError("timed out", running_ranks=[0, 1], log_dir="/logs"),
    ]
    for error in errors:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error)
        assert back.__dict__ == error.__dict__ and is_transient(back)


def test_resource_error_is_not_transient():
    from trainflow.launch.plan import ResourceError

    assert not is_transient(ResourceError("gpus=8 but this machine has 0 GPUs"))


def test_preempted_names_rank_and_step_and_survives_pickling():
    import cloudpickle

    exc = Preempted(rank=1, step=12)
    assert str(exc) == "rank 1 stopped on request after step 12"
    back = cloudpickle.loads(cloudpickle.dumps(exc))
    assert (str(back), back.rank, back.step) == (str(exc), 1, 12)
    assert str(Preempted("rank 0 stopped on request after step 4 (checkpoint x)")).endswith("x)")
