"""Rank 0's metrics sink against a real SQLite MLflow store (the test's own, see conftest)."""

import subprocess
import sys
import textwrap
import time

import pytest
from mlflow.exceptions import MlflowException

from trainflow import tracking


def _run_id() -> str:
    client = tracking.store_client()
    return client.create_run(client.create_experiment("sink")).info.run_id


def test_everything_logged_before_a_flush_is_stored_in_step_order():
    run_id = _run_id()
    sink = tracking.MlflowSink(run_id, flush_every=7)  # flushes by itself along the way
    for step in range(1, 51):
        sink.log(step, {"loss": 1.0 / step, "lr": 0.1})
    sink.flush()
    client = tracking.store_client()
    losses = client.get_metric_history(run_id, "loss")
    assert [m.step for m in sorted(losses, key=lambda m: m.step)] == list(range(1, 51))
    assert {m.step: m.value for m in losses}[4] == pytest.approx(0.25)
    assert len(client.get_metric_history(run_id, "lr")) == 50


def test_a_failed_write_is_raised_by_the_next_flush_and_not_again():
    sink = tracking.MlflowSink("0" * 32)  # no such run
    sink.log(1, {"loss": 1.0})
    with pytest.raises(MlflowException, match="0" * 32):
        sink.flush()
    sink.flush()  # reported once


def test_ending_a_run_after_the_sink_finds_mlflows_async_queue_unused():
    """MLflow's async logging, once used, makes ending the run wait for its thread's next
    queue poll (up to a second); the sink never starts that thread."""
    script = textwrap.dedent(
        f"""
        import threading
        from mlflow.tracking import MlflowClient
        from trainflow import tracking

        sink = tracking.MlflowSink({_run_id()!r})
        for step in range(5):
            sink.log(step, {{"loss": 1.0}})
        sink.flush()
        print(sorted(t.name for t in threading.enumerate()))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "mlflow-sink" in out
    assert "MLflowAsyncLoggingLoop" not in out


def test_logs_in_quick_succession_are_stored_together_after_the_first():
    """The first `log` is written at once; those within `interval_s` of a write wait for the
    next one (or a flush), so short steps cost one store transaction per interval."""
    run_id = _run_id()
    client = tracking.store_client()
    sink = tracking.MlflowSink(run_id, interval_s=60.0)
    sink.log(1, {"loss": 1.0})
    deadline = time.monotonic() + 30
    while not client.get_metric_history(run_id, "loss") and time.monotonic() < deadline:
        time.sleep(0.05)
    for step in (2, 3):
        sink.log(step, {"loss": 1.0 / step})
    time.sleep(1.0)
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1]
    sink.flush()  # writes at once, without waiting out the interval
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2, 3]
