"""Launch folders are pruned, and progress bars reach the caller as readable lines."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainflow.errors import LaunchConfigError
from trainflow.launch import logs, run_dir
from trainflow.launch.run_dir import RunDir


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _launch_folder(root: Path, name: str, caller_pid: int, age_s: int) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "spec.json").write_text(json.dumps({"caller_pid": caller_pid}))
    stamp = 1_700_000_000 - age_s
    os.utime(folder, (stamp, stamp))
    return folder


def test_pruning_keeps_the_newest_and_every_folder_still_in_use(tmp_path):
    dead = _dead_pid()
    folders = [_launch_folder(tmp_path, f"run-{i}", dead, age_s=i) for i in range(5)]
    in_use = _launch_folder(tmp_path, "run-old-live", os.getpid(), age_s=100)
    (tmp_path / "stray-file").write_text("not a launch")

    removed = run_dir.prune_run_dirs(tmp_path, keep=2)

    assert sorted(removed) == sorted(folders[2:])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "run-0",
        "run-1",
        "run-old-live",
        "stray-file",
    ]
    assert in_use.is_dir()
    assert run_dir.prune_run_dirs(tmp_path / "missing", keep=2) == []


def test_keep_runs_setting_is_read_and_checked(monkeypatch):
    monkeypatch.delenv("TRAINFLOW_KEEP_RUNS", raising=False)
    assert run_dir.keep_run_dirs() == run_dir.DEFAULT_KEEP_RUNS
    monkeypatch.setenv("TRAINFLOW_KEEP_RUNS", "7")
    assert run_dir.keep_run_dirs() == 7
    for bad in ("0", "-1", "many"):
        monkeypatch.setenv("TRAINFLOW_KEEP_RUNS", bad)
        with pytest.raises(LaunchConfigError, match="TRAINFLOW_KEEP_RUNS"):
            run_dir.keep_run_dirs()


def test_progress_bars_arrive_as_their_newest_redraw_then_their_final_state(tmp_path, monkeypatch):
    rd = RunDir(tmp_path)
    rd.logs.mkdir()
    log = rd.log_path(0)
    lines: list[tuple[int, str]] = []
    tail = logs.LogTail(rd, lambda rank, line: lines.append((rank, line)))
    now = [100.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: now[0])

    def write(text: str, at: float) -> None:
        now[0] = at
        with open(log, "a") as f:
            f.write(text)
        tail.poll()

    write("loading\n 10%|#  | 1/10\r 20%|## | 2/10\r 30%", 100.0)
    assert lines == [(0, "loading"), (0, " 20%|## | 2/10")]  # the newest complete redraw
    write("|###| 3/10\r 40%|####| 4/10\r", 100.5)
    assert len(lines) == 2  # within PROGRESS_EVERY_S of the last one: held back
    write(" 50%|#####| 5/10\r", 103.0)
    assert lines[-1] == (0, " 50%|#####| 5/10")
    write("100%|##########| 10/10\n", 103.5)
    assert lines[-1] == (0, "100%|##########| 10/10")  # the bar's final state, whole
    assert all("\r" not in line for _, line in lines)


def test_a_poll_says_whether_anything_was_written_and_finds_a_log_that_appears_later(tmp_path):
    rd = RunDir(tmp_path)
    rd.logs.mkdir()
    lines: list[tuple[int, str]] = []
    tail = logs.LogTail(rd, lambda rank, line: lines.append((rank, line)))
    assert tail.poll() is False  # no log yet
    rd.log_path(1).write_text("hello\n")
    assert tail.poll(final=True) is True  # the final poll lists the folder again
    assert tail.poll() is False  # nothing new
    assert lines == [(1, "hello")]


def test_stopping_a_failed_attempt_spares_the_ranks_of_the_next_one(tmp_path):
    """With restarts, the agent may start attempt 1 between a failure's detection and the kill."""
    from trainflow.launch.processes import kill_ranks, live_ranks

    rd = RunDir(tmp_path)
    rd.ranks.mkdir(parents=True)
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    new = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        rd.write_rank_process(0, new.pid, attempt=1)  # rank 0 already restarted
        rd.write_rank_process(1, old.pid, attempt=0)  # rank 1 not yet
        pgid = os.getpgid(0)
        assert live_ranks(rd, pgid) == {0: new.pid}
        assert live_ranks(rd, pgid, attempt=0) == {1: old.pid}
        kill_ranks(rd, pgid, attempt=0)
        assert old.wait(timeout=10) == -9
        assert new.poll() is None
    finally:
        for proc in (old, new):
            proc.kill()
            proc.wait()
