"""How the sweep waits on its trials (`flows.sweep.first_done`): back as soon as one is done,
or empty-handed at the timeout. It replaces Prefect's `wait(timeout=...)`, whose timeout is a
SIGALRM in the main thread: an alarm that lands while the waiting thread takes its lock back
fails the wait ('release unlocked lock'), and a Ctrl-C'd sweep then exited 1 instead of 130."""

import time

from prefect import flow, task
from prefect.task_runners import ThreadPoolTaskRunner

from flows.sweep import first_done


@task
def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
def _waits() -> dict:
    fast, slow = nap.submit(0.3), nap.submit(3.0)
    start = time.monotonic()
    done = first_done([fast, slow], 10.0)
    took = time.monotonic() - start
    start = time.monotonic()
    still = first_done([slow], 0.2)
    waited = time.monotonic() - start
    slow.wait()
    return {
        "fast_only": done == {fast},
        "took": took,
        "none_yet": still == set(),
        "waited": waited,
        "then": first_done([fast, slow], 0.0) == {fast, slow},
    }


def test_the_sweep_is_back_when_the_first_trial_ends_or_at_the_timeout(prefect_api):
    seen = _waits()
    assert seen["fast_only"], seen
    assert seen["took"] < 2.5, seen  # the first to finish, not the slow one or the timeout
    assert seen["none_yet"] and 0.15 < seen["waited"] < 2.0, seen
    assert seen["then"], seen
