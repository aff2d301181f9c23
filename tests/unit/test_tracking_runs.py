"""MLflow runs over their life: owner tags, reaping runs whose process died, resuming, finding.

Against a real SQLite store (the test's own, see conftest) and real processes: a dead owner
is a subprocess that has exited.
"""

import os
import re
import socket
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from trainflow import tracking


def _client() -> MlflowClient:
    return tracking.store_client()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _orphan(experiment: str, pid: int, started: float = 1.0, host: str | None = None) -> str:
    """A RUNNING run owned by process `pid` (started at `started`) of `host`."""
    client = _client()
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    run = client.create_run(
        experiment_id,
        tags={
            tracking.OWNER_HOST_TAG: host or socket.gethostname(),
            tracking.OWNER_PID_TAG: str(pid),
            tracking.OWNER_START_TAG: repr(started),
        },
    )
    return run.info.run_id


def _experiment_id(name: str) -> str:
    return _client().get_experiment_by_name(name).experiment_id


def test_a_run_is_tagged_with_its_owner_and_ends_with_the_right_status():
    import psutil

    with tracking.pipeline_run("e", "ok", {"a": {"b": 1}}, {"k": "v"}) as run_id:
        assert tracking.last_run_id() == run_id
    run = _client().get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"a.b": "1"} and run.data.tags["k"] == "v"
    assert run.data.tags[tracking.OWNER_HOST_TAG] == socket.gethostname()
    assert run.data.tags[tracking.OWNER_PID_TAG] == str(os.getpid())
    assert float(run.data.tags[tracking.OWNER_START_TAG]) == pytest.approx(
        psutil.Process().create_time(), abs=0.5
    )
    with pytest.raises(RuntimeError), tracking.pipeline_run("e", "fails", {}) as failed:
        raise RuntimeError("boom")
    assert _client().get_run(failed).info.status == "FAILED"


@pytest.mark.parametrize(
    "stop",
    [
        KeyboardInterrupt(),
        SystemExit(1),
        type("TerminationSignal", (BaseException,), {})(),
        type("Preempted", (RuntimeError,), {})(),
        type("CancelledRun", (BaseException,), {})(),
    ],
    ids=lambda e: type(e).__name__,
)
def test_stops_end_the_run_killed(stop):
    with pytest.raises(type(stop)), tracking.pipeline_run("e", "stopped", {}) as run_id:
        raise stop
    assert _client().get_run(run_id).info.status == "KILLED"


def test_runs_of_dead_processes_here_are_reaped_and_others_left_alone():
    import psutil

    dead = _dead_pid()
    me = psutil.Process()
    orphan = _orphan("e", dead, me.create_time())
    reused = _orphan("e", os.getpid(), me.create_time() - 3600)  # this pid, an earlier process
    live = _orphan("e", os.getpid(), me.create_time())
    elsewhere = _orphan("e", dead, host="another-host")
    other_experiment = _orphan("f", dead)

    reaped = tracking.reap_orphaned_runs(_client(), _experiment_id("e"))

    assert sorted(reaped) == sorted([orphan, reused])
    client = _client()
    run = client.get_run(orphan)
    assert run.info.status == "FAILED"
    assert run.data.tags[tracking.FAILURE_REASON_TAG] == (
        f"the process that ran it (pid {dead} on {socket.gethostname()}) exited without "
        "ending the run (killed or crashed)"
    )
    assert client.get_run(reused).info.status == "FAILED"
    for left in (live, elsewhere, other_experiment):
        assert client.get_run(left).info.status == "RUNNING"
    assert tracking.reap_orphaned_runs(client, _experiment_id("e")) == []


def test_starting_a_pipeline_reaps_its_experiment_first():
    orphan = _orphan("e", _dead_pid())
    with tracking.pipeline_run("e", "next", {}):
        assert _client().get_run(orphan).info.status == "FAILED"


def test_resume_continues_the_same_run_with_a_new_owner():
    with pytest.raises(KeyboardInterrupt), tracking.pipeline_run("e", "r", {"lr": 1}) as run_id:
        raise KeyboardInterrupt
    with tracking.pipeline_run("e", "ignored", {"lr": 2}, resume_run_id=run_id) as resumed:
        assert resumed == run_id and tracking.last_run_id() == run_id
        run = _client().get_run(run_id)
        assert run.info.status == "RUNNING"
        assert run.data.tags[tracking.RESUMED_TAG] == "1"
        assert run.data.params == {"lr": "1"}  # params are the run's own, not logged again
    assert _client().get_run(run_id).info.status == "FINISHED"
    runs = _client().search_runs([_experiment_id("e")])
    assert [r.info.run_id for r in runs] == [run_id]  # no new run


def test_resuming_a_reaped_run_counts_and_drops_the_failure_reason():
    orphan = _orphan("e", _dead_pid())
    with (
        pytest.raises(KeyboardInterrupt),
        tracking.pipeline_run("e", "again", {}, resume_run_id=orphan),
    ):
        run = _client().get_run(orphan)
        assert tracking.FAILURE_REASON_TAG not in run.data.tags
        assert run.data.tags[tracking.OWNER_PID_TAG] == str(os.getpid())
        raise KeyboardInterrupt
    assert _client().get_run(orphan).info.status == "KILLED"
    with (
        pytest.raises(RuntimeError),
        tracking.pipeline_run("e", "again", {}, resume_run_id=orphan),
    ):
        raise RuntimeError("fails again")
    run = _client().get_run(orphan)
    assert run.info.status == "FAILED"
    assert run.data.tags[tracking.RESUMED_TAG] == "2"


def test_resume_refuses_what_cannot_be_continued():
    import psutil

    with tracking.pipeline_run("e", "done", {}) as finished:
        pass
    with tracking.pipeline_run("other", "elsewhere", {}) as other:
        pass
    live = _orphan("e", os.getpid(), psutil.Process().create_time())
    cases = [
        (finished, "already finished; nothing to resume"),
        ("0123456789abcdef0123456789abcdef", "no such run"),
        (other, "is in 'other'"),
        (live, f"still running (pid {os.getpid()}"),
    ]
    for run_id, message in cases:
        with (
            pytest.raises(ValueError, match=re.escape(message)) as info,
            tracking.pipeline_run("e", "x", {}, resume_run_id=run_id),
        ):
            pass
        assert run_id in str(info.value)
    assert _client().get_run(finished).info.status == "FINISHED"
    assert _client().get_run(live).info.status == "RUNNING"


def test_find_unfinished_run_returns_the_newest_not_finished():
    assert tracking.find_unfinished_run("missing", "flow", "a") is None
    with tracking.pipeline_run("e", "done", {}, {"flow": "a"}):
        pass
    assert tracking.find_unfinished_run("e", "flow", "a") is None
    for value in ("a", "it's"):
        ids = []
        for _ in range(2):
            with (
                pytest.raises(KeyboardInterrupt),
                tracking.pipeline_run("e", "stopped", {}, {"flow": value}) as run_id,
            ):
                raise KeyboardInterrupt
            ids.append(run_id)
        assert tracking.find_unfinished_run("e", "flow", value) == ids[-1]
    assert tracking.find_unfinished_run("e", "flow", "b") is None
    assert tracking.find_unfinished_run("e", "other-tag", "a") is None


def test_ranks_preempted_on_their_own_end_the_run_killed_not_failed():
    from trainflow.errors import RankError
    from trainflow.tracking import is_stop

    def rank_error(exc_type: str) -> RankError:
        return RankError("x", rank=1, exc_type=exc_type, remote_traceback="", failed_ranks=[1])

    assert is_stop(rank_error("trainflow.errors.Preempted"))
    assert not is_stop(rank_error("builtins.ValueError"))


def test_a_store_is_opened_ahead_only_if_it_exists(tmp_path, monkeypatch):
    missing = tmp_path / "new" / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{missing}")
    tracking.open_store_ahead()
    assert not missing.parent.exists(), "a store not made yet is left to the run"

    broken = tmp_path / "broken.db"
    broken.write_bytes(b"not a database")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{broken}")
    tracking.open_store_ahead()  # the run meets the error, not the check
    assert tracking.tracking_uri() not in tracking._READY

    made = tmp_path / "made.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{made}")
    tracking.store_client()  # an earlier run made it
    tracking._READY.discard(tracking.tracking_uri())
    tracking.open_store_ahead()
    assert tracking.tracking_uri() in tracking._READY
