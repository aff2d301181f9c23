"""An agent started ahead of its launch (`trainflow.launch.backends.standby`): used, passed
over, or stopped."""

import gc
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from trainflow import runtime
from trainflow.launch.backends import launch, standby
from trainflow.launch.spec import LaunchOptions

OPTIONS = LaunchOptions(gpus=2, gpu_type="cpu", timeout=120)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _standby_pids() -> list[int]:
    return [
        p.pid
        for p in psutil.Process().children()
        if "--standby" in " ".join(p.cmdline()) and _alive(p.pid)
    ]


def _what_the_rank_sees() -> dict:
    return {
        "rank": runtime.get_global_rank(),
        "late": os.environ.get("SET_AFTER_STANDBY"),
        "preloaded": "tests.unit.conftest_data" in sys.modules,
    }


def test_a_launch_uses_the_agent_started_ahead_with_the_environment_of_the_launch(monkeypatch):
    discard = standby(OPTIONS, ["tests.unit.conftest_data"])
    (pid,) = _standby_pids()
    # Set after the agent started (as MLflow sets its tracking URI): the ranks still get it.
    monkeypatch.setenv("SET_AFTER_STANDBY", "yes")
    result = launch(_what_the_rank_sees, options=OPTIONS, on_line=lambda r, line: None)
    assert result.values == [
        {"rank": 0, "late": "yes", "preloaded": True},
        {"rank": 1, "late": "yes", "preloaded": True},
    ]
    agent_log = (result.run_dir / "agent.log").read_text()
    assert "standby agent: imported tests.unit.conftest_data" in agent_log
    assert not _alive(pid)  # it ran the launch and ended with it
    discard()  # used: nothing left to stop
    assert not list(Path(tempfile.gettempdir()).glob(f"trainflow-standby-{os.getpid()}-*"))


def _rank_modules() -> dict:
    warmed = sys.modules.get("ahead_dependency")
    return {
        "dependency": "ahead_dependency" in sys.modules,
        "warmed": getattr(warmed, "WARMED", None),
    }


def test_the_agent_also_imports_what_the_module_lists_for_its_ranks(tmp_path, monkeypatch):
    # A workload module names what its ranks import only once they run (`RANK_IMPORTS`), and
    # what they would build on first use (`RANK_WARMUPS`); the agent imports and builds those
    # too, skipping what is not installed or fails, and the ranks fork with them.
    (tmp_path / "ahead_workload.py").write_text(
        'RANK_IMPORTS = ("ahead_dependency", "no_such_distribution.sub")\n'
        'RANK_WARMUPS = ("ahead_dependency:warm", "ahead_dependency:broken")\n'
    )
    (tmp_path / "ahead_dependency.py").write_text(
        "WARMED = None\n"
        "def warm():\n    global WARMED\n    WARMED = 'in the agent'\n"
        "def broken():\n    raise OSError('no cache here')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # the agent imports from the caller's path
    discard = standby(OPTIONS, ["ahead_workload"])
    result = launch(_rank_modules, options=OPTIONS, on_line=lambda r, line: None)
    assert result.values == [{"dependency": True, "warmed": "in the agent"}] * 2
    agent_log = (result.run_dir / "agent.log").read_text()
    assert "standby agent: imported ahead_workload, ahead_dependency in" in agent_log
    assert "could not import" not in agent_log
    assert "standby agent: ran ahead_dependency:warm in" in agent_log
    assert "warm-up ahead_dependency:broken failed: OSError('no cache here')" in agent_log
    discard()


def test_a_launch_with_other_options_starts_its_own_agent_and_the_unused_one_is_stopped():
    discard = standby(LaunchOptions(gpus=2, gpu_type="cpu", env={"SETTING": "a"}))
    (pid,) = _standby_pids()
    other = LaunchOptions(gpus=2, gpu_type="cpu", timeout=120, env={"SETTING": "b"})
    result = launch(_what_the_rank_sees, options=other, on_line=lambda r, line: None)
    assert [v["rank"] for v in result.values] == [0, 1]
    assert "standby agent" not in (result.run_dir / "agent.log").read_text()
    assert _alive(pid)
    discard()
    assert not _alive(pid)
    assert not list(Path(tempfile.gettempdir()).glob(f"trainflow-standby-{os.getpid()}-*"))


def test_the_agent_started_ahead_ends_when_its_caller_is_killed(tmp_path):
    script = textwrap.dedent(
        """
        import os, signal, sys, time
        from trainflow.launch.backends import standby
        from trainflow.launch.spec import LaunchOptions
        from trainflow.launch.standby import _pool
        standby(LaunchOptions(gpus=2, gpu_type="cpu"), ["json"])
        print(_pool.agents[0].proc.pid, os.getpid(), flush=True)
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), "the standby agent outlived the process that started it"
    # Its early log, in the temp folder until a launch claims it, went with it.
    caller = proc.stdout.split()[1]
    assert not list(Path(tempfile.gettempdir()).glob(f"trainflow-standby-{caller}-*"))


def test_a_listed_module_that_fails_to_import_is_named_and_the_rest_still_load(
    tmp_path, monkeypatch
):
    from trainflow.launch.agent import _preload

    (tmp_path / "listing_workload.py").write_text(
        'RANK_IMPORTS = ("listing_broken", "listing_fine")\n'
    )
    (tmp_path / "listing_broken.py").write_text("raise RuntimeError('needs a GPU driver')\n")
    (tmp_path / "listing_fine.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    done, failed = _preload("listing_workload")
    assert done == ["listing_workload", "listing_fine"]
    assert failed == [
        "listing_broken (RANK_IMPORTS of listing_workload): RuntimeError('needs a GPU driver')"
    ]
    # A workload module that cannot be imported at all is named the same way.
    assert _preload("listing_missing") == (
        [],
        ["listing_missing: ModuleNotFoundError(\"No module named 'listing_missing'\")"],
    )


def imported(name: str) -> bool:
    """A check for the agent: has it imported `name` yet?"""
    return name in sys.modules


def test_the_agent_runs_the_check_it_is_given_before_its_imports_then_the_launch():
    check = ("tests.distributed.test_standby_agent:imported", "tests.unit.conftest_data")
    agent = standby(OPTIONS, ["tests.unit.conftest_data"], check=check)
    # The caller's answer does not wait for what only the ranks need.
    assert agent.check_outcome() == {"value": False}
    again = standby(OPTIONS, ["tests.unit.conftest_data"], check=check)
    assert again.check_outcome() == {"value": False}  # the same agent, its answer kept
    result = launch(_what_the_rank_sees, options=OPTIONS, on_line=lambda r, line: None)
    assert [v["preloaded"] for v in result.values] == [True, True]  # the same agent ran it
    agent()
    assert not list(Path(tempfile.gettempdir()).glob(f"trainflow-standby-{os.getpid()}-*"))


def test_a_check_that_refuses_the_config_says_why_and_one_that_breaks_gives_its_traceback():
    refused = standby(OPTIONS, [], check=("json:loads", "not json"))
    assert refused.check_outcome() == {"refused": "Expecting value: line 1 column 1 (char 0)"}
    refused()  # another check needs an agent of its own
    broken = standby(OPTIONS, [], check=("math:sqrt", "four"))
    outcome = broken.check_outcome()
    assert list(outcome) == ["failed"]
    assert "TypeError: must be real number, not str" in outcome["failed"]
    broken()
    assert _standby_pids() == []
    assert not list(Path(tempfile.gettempdir()).glob(f"trainflow-standby-{os.getpid()}-*"))


def test_calls_after_the_check_run_in_order_before_the_imports_and_stop_at_a_refusal():
    check = ("tests.distributed.test_standby_agent:imported", "tests.unit.conftest_data")
    then = [("json:loads", "[2]"), ("tests.distributed.test_standby_agent:imported", "streaming")]
    agent = standby(OPTIONS, ["tests.unit.conftest_data"], check=check, then=then)
    # Asked in any order, each call's own outcome; all ran before the preload was imported.
    assert agent.outcome(then[1]) == {"value": False}
    assert agent.outcome(then[0]) == {"value": [2]}
    assert agent.check_outcome() == {"value": False}
    assert agent.outcome(("json:loads", "[3]")) is None  # not asked of this agent
    agent()

    refused = standby(OPTIONS, [], check=("json:loads", "not json"), then=then)
    assert "refused" in refused.check_outcome()
    assert refused.outcome(then[0]) is None  # skipped: the caller does it, if it still wants it
    assert refused.outcome(then[1]) is None
    refused()
    assert _standby_pids() == []
    assert not list(Path(tempfile.gettempdir()).glob(f"trainflow-standby-{os.getpid()}-*"))


def writes_until_stopped(marker: str) -> None:
    """A call for the agent that leaves a file only while it runs, as a dataset's build
    leaves its staging folder."""
    path = Path(marker)
    path.write_text(str(os.getpid()))
    try:
        time.sleep(60)
    finally:
        path.unlink()


def test_an_agent_stopped_mid_call_lets_the_call_clean_up(tmp_path):
    marker = tmp_path / "staging"
    call = ("tests.distributed.test_standby_agent:writes_until_stopped", str(marker))
    agent = standby(OPTIONS, [], check=("json:loads", "[1]"), then=[call])
    assert agent.check_outcome() == {"value": [1]}
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(marker.read_text())
    started = time.monotonic()
    agent()  # the pipeline ends (Ctrl-C) while the agent still prepares
    assert time.monotonic() - started < 3  # SIGTERM was enough: no wait for the SIGKILL
    assert not marker.exists() and not psutil.pid_exists(pid)
    assert _standby_pids() == []


def test_without_an_agent_the_caller_is_told_to_check_itself(monkeypatch):
    monkeypatch.setenv("TRAINFLOW_STANDBY", "0")
    ahead = standby(OPTIONS, [], check=("json:loads", "[1]"))
    assert ahead.check_outcome() is None and _standby_pids() == []
    ahead()


def _collector() -> dict:
    return {
        "on": gc.isenabled(),
        "frozen": gc.get_freeze_count() > 0,
        "full_collections": gc.get_stats()[2]["collections"],
    }


@pytest.mark.parametrize("ahead", [True, False])
def test_ranks_train_with_the_collector_on_after_an_agent_that_imported_without_it(ahead):
    # The agent imports with the cyclic collector off (its full collections of a growing heap
    # free next to nothing); the ranks forked from it must train with it on, with what the
    # agent loaded frozen out of its sight. Collection counts are inherited through the fork.
    discard = standby(OPTIONS, ["tests.unit.conftest_data"]) if ahead else None
    try:
        result = launch(_collector, options=OPTIONS, on_line=lambda r, line: None)
    finally:
        if discard is not None:
            discard()
    for seen in result.values:
        assert seen["on"] and seen["frozen"], seen
        assert seen["full_collections"] < 2, seen
