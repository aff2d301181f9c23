"""The plan of a run as a Prefect artifact: a flow started with `dry_run` shows it and stops."""

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from trainflow.pipelines import PipelineSpec


@task(name="plan-run", cache_policy=NO_CACHE)
def plan_run(spec: PipelineSpec, config: Any) -> None:
    """Publish the run's plan (`trainflow.dryrun`) as `<pipeline>-plan`; nothing else starts.

    Raises:
        ValueError: the run would not fit, naming what does not (the flow run fails).
    """
    from flows.command import deployment_of
    from trainflow.dryrun import plan_run as make_plan

    plan = make_plan(spec, config, deployment=deployment_of(spec, config))
    print(plan.text())
    create_markdown_artifact(
        key=f"{spec.name.replace('_', '-')}-plan",
        markdown=plan.markdown(),
        description=f"Dry run of {spec.name}",
    )
    if not plan.fits:
        raise ValueError(f"dry run: {'; '.join(plan.problems)}")
