"""Prefect flows, one pipeline per module: `python -m flows.<name>`."""

import gc
import os
import sys

# Pipelines run offline by default: the local Prefect server sends no usage telemetry unless
# the user opts in.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _start_ahead() -> None:
    """`python -m flows.<name>` of a pipeline with a `start_agent` hook (SFT): start its
    training launch's agent now, before the flow's module imports Prefect (about a second of
    one core, while the other has nothing to do). See `trainflow.cli.start_ahead`."""
    argv = getattr(sys, "orig_argv", [])
    if "-m" not in argv[:-1]:
        return
    at = argv.index("-m")
    name = argv[at + 1].removeprefix("flows.")
    if name == argv[at + 1]:
        return
    gc.disable()  # a pipeline's start-up is mostly imports: see `trainflow.cli.pause_collector`
    _check_environment(name)
    from trainflow.cli import pause_collector, refuse_resume_ahead, start_ahead
    from trainflow.pipelines import PIPELINES

    spec = PIPELINES.get(name)
    if spec is None:  # not a pipeline (`flows.local_server`, `flows.sweep`): as it was
        gc.enable()
        return
    pause_collector()  # `run_pipeline` turns it on again as the flow starts
    args = argv[at + 2 :]
    if spec.startup_hook("command_line") is None:
        refuse_resume_ahead(name, spec.defaults(), args, spec.presets_by_name())
    ahead = spec.startup_hook("start_agent")
    if ahead is None:
        return
    check = spec.startup_hook("check_files")
    start_ahead(name, spec.defaults(), args, spec.presets_by_name(), check, ahead)


def _check_environment(name: str) -> None:
    """A location a pipeline config's default reads from the environment is checked here, so a
    bad one is a usage error naming the variable, not a traceback from the first config."""
    root = os.environ.get("TRAINFLOW_OUTPUT_ROOT")
    if not root:
        return
    from trainflow.storage import check_output_root

    try:
        check_output_root(root)
    except ValueError as err:
        print(f"python -m flows.{name}: error: TRAINFLOW_OUTPUT_ROOT: {err}", file=sys.stderr)
        raise SystemExit(2) from None


_start_ahead()
