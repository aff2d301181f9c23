"""`python -m flows.<name>`: the command line of every registered pipeline, read from its spec.

    def main(argv: list[str] | None = None) -> PipelineResult:
        return command.main("mlp", argv)

The spec (`trainflow.pipelines`) gives the starting config and presets, the checks run before
the Prefect server starts (its `checks`: a bad value is a usage error, and nothing has started)
and while it starts, the metrics printed at the end, and `--dry-run`.
The SFT pipeline's launch agent starts before the flow's module imports Prefect (`flows/__init__`).
"""

import importlib
import sys
from typing import Any, NoReturn

from trainflow.cli import exit_now, pipeline_config, run_pipeline, start_launch_agent
from trainflow.pipelines import PipelineSpec, pipeline


def flow_of(spec: PipelineSpec) -> Any:
    """The pipeline's flow object (`flows/<name>.py:<name>`)."""
    return getattr(importlib.import_module(spec.flow_module), spec.name)


def parse_args(name: str, argv: list[str] | None) -> Any:
    """The command line of pipeline `name` as a validated config (`--preset` starts it)."""
    spec = pipeline(name)
    flow = flow_of(spec)
    doc = sys.modules[spec.flow_module].__doc__
    presets = spec.presets_by_name() or None
    return pipeline_config(flow, spec.defaults(), _arguments(spec, argv), doc, presets)


def _arguments(spec: PipelineSpec, argv: list[str] | None) -> list[str]:
    """The command line as the options parser reads it (a framework's positional file)."""
    args = list(sys.argv[1:] if argv is None else argv)
    command_line = spec.startup_hook("command_line")
    return list(command_line(args)) if command_line is not None else args


def main(name: str, argv: list[str] | None = None) -> Any:
    """Run pipeline `name` from the command line `argv` (None: `sys.argv[1:]`)."""
    from flows.local_server import starting_prefect_server

    spec = pipeline(name)
    flow = flow_of(spec)
    return run_pipeline(
        flow,
        spec.defaults(),
        _arguments(spec, argv),
        sys.modules[spec.flow_module].__doc__,
        spec.presets_by_name() or None,
        list(spec.summary_metrics) or None,
        server=starting_prefect_server,
        check=spec.startup_hook("check_files") or spec.check(),
        deep_check=spec.startup_hook("deep_check") or _deep_check(spec),
        dry_run=lambda config: dry_run(spec, config),
    )


def run(name: str) -> NoReturn:
    """`if __name__ == "__main__"` of a flow file: run it, then end the process at once."""
    main(name, sys.argv[1:])
    exit_now()  # the pipeline is done: skip only the interpreter's teardown


def _deep_check(spec: PipelineSpec) -> Any:
    """Start the training launch's agent (it imports the workload for the ranks meanwhile),
    then load the workload here, import `spec.preload` and open the MLflow store if it exists.
    (The pipeline's checks ran before the server started.)"""

    def check(config: Any) -> None:
        if spec.workload is not None:
            start_launch_agent(config, spec.workload.module)
            spec.workload.load()  # what the flow's process runs once training is done
        for name in spec.preload:
            importlib.import_module(name)
        from trainflow import tracking

        tracking.open_store_ahead()  # while the server starts

    return check


def deployment_of(spec: PipelineSpec, config: Any) -> tuple[str, str | None] | None:
    """The deployment in prefect.yaml whose parameters are `config`, and its work pool."""
    from deployments.catalog import deployments

    for entry in deployments():
        if entry.entrypoint != spec.entrypoint:
            continue
        params = entry.parameters.get("config")
        if params is None:
            continue
        try:
            deployed = spec.config_class().model_validate(params)
        except ValueError:
            continue
        if deployed.model_dump() == config.model_dump():
            return f"{spec.name}/{entry.name}", entry.work_pool
    return None


def dry_run(spec: PipelineSpec, config: Any) -> bool:
    """Print the run's plan (`trainflow.dryrun`); whether it would fit."""
    from trainflow.dryrun import plan_run

    plan = plan_run(spec, config, deployment=deployment_of(spec, config))
    print(plan.text())
    if not plan.fits:
        problems = "; ".join(plan.problems)
        print(f"python -m flows.{spec.name}: error: dry run: {problems}", file=sys.stderr)
    return plan.fits
