"""A task submitted beside a run's next steps (the loss plot) runs beside them."""

import threading

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.skeleton import TrackedRun
from trainflow.pipelines import PIPELINES

RELEASED = threading.Event()


@task(cache_policy=NO_CACHE)
def plot() -> str:
    """Stands for the loss plot: ends once the next step has run, or gives up."""
    return "ran beside" if RELEASED.wait(timeout=60) else "waited for"


@task(cache_policy=NO_CACHE)
def evaluate(run: TrackedRun) -> str:
    """Stands for a step after training: it takes the run, as the evaluation does."""
    RELEASED.set()
    return run.run_id


@flow
def pipeline(output_dir: str) -> list[str]:
    run = TrackedRun(PIPELINES["mlp"].ranks, None, "run-1", output_dir, {})
    run.pending.add(plot.submit())
    evaluated = evaluate(run)
    run.pending.results()
    return [evaluated, run.pending._futures[0].result()]


def test_the_step_after_training_does_not_wait_for_the_plot(prefect_api, tmp_path):
    RELEASED.clear()
    assert pipeline(str(tmp_path)) == ["run-1", "ran beside"]
