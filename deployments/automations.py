"""Automations our deployments rely on, created (or updated) on the Prefect server.

A flow run whose process dies without a word (a SIGKILL, the OOM killer, an evicted pod, a
machine gone) stays Running in Prefect: nothing is left to report that it ended. Each flow
run's process sends a heartbeat event every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (Prefect
3's default: 180; at least 30); `crash_silent_runs` marks Crashed a flow run that has sent a
heartbeat, or started, and then sent neither another heartbeat nor a final state for
`missed` heartbeats (Prefect's "detect zombie flows" recipe). Subflow runs beat from the
process of their parent, so a sweep's trials end Crashed with it.

    prefect server start &                                  # or any PREFECT_API_URL
    python -m deployments.automations                       # for Prefect's default heartbeat
    python -m deployments.automations --heartbeat-s 30      # workers with a 30 s heartbeat

The heartbeat must be the one every process that runs flows against this server uses (workers,
`python -m deployments.serve`, runs started by hand): a run that beats slower than the
automation expects is crashed while it still runs. See docs/cancellation.md.
"""

import argparse
from datetime import timedelta
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification
from prefect.settings import get_current_settings

CRASH_SILENT_RUNS = "trainflow: crash flow runs that stopped sending heartbeats"
# Added to the window, for a heartbeat that is a little late (a busy machine, a slow network).
GRACE_S = 15.0
# Events that say a run ended, or that it stopped beating on purpose: suspended or paused, or
# waiting out a retry delay (it starts a new window when it runs again).
_ENDED = ("Completed", "Failed", "Cancelled", "Crashed", "Suspended", "Paused", "AwaitingRetry")


def crash_silent_runs(heartbeat_s: float, missed: int = 3) -> AutomationCore:
    """The automation marking Crashed a flow run silent for `missed` heartbeats of
    `heartbeat_s` seconds (plus `GRACE_S`)."""
    if missed < 1 or heartbeat_s <= 0:
        raise ValueError(f"missed ({missed}) and heartbeat_s ({heartbeat_s}) must be positive")
    within = timedelta(seconds=missed * heartbeat_s + GRACE_S)
    return AutomationCore(
        name=CRASH_SILENT_RUNS,
        description=(
            f"A flow run that sent no heartbeat for {within.total_seconds():.0f} s (heartbeats "
            f"every {heartbeat_s:.0f} s) lost its process: mark it Crashed. "
            "Made by `python -m deployments.automations`."
        ),
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat", "prefect.flow-run.Running"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in _ENDED)},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=within,
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=(
                    f"No heartbeat for {within.total_seconds():.0f} s: the process running "
                    "this flow run is gone (killed, out of memory, or its machine lost)."
                ),
            )
        ],
    )


def apply(automation: AutomationCore) -> UUID:
    """Create `automation` on the server, or update the one of the same name; its id."""
    with get_client(sync_client=True) as client:
        existing = client.read_automations_by_name(name=automation.name)
        if not existing:
            return client.create_automation(automation)
        client.update_automation(existing[0].id, automation)
        return existing[0].id


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.automations",
        description="Create or update the automation that marks Crashed the flow runs whose "
        "process died without reporting (no heartbeat).",
    )
    parser.add_argument(
        "--heartbeat-s",
        type=float,
        default=get_current_settings().flows.heartbeat_frequency or 180,
        help="Seconds between heartbeats of the processes that run flows "
        "(their PREFECT_FLOWS_HEARTBEAT_FREQUENCY; default: this process's, %(default)s).",
    )
    parser.add_argument(
        "--missed",
        type=int,
        default=3,
        help="Heartbeats missed in a row before a run is marked Crashed (default %(default)s).",
    )
    args = parser.parse_args(argv)
    try:
        wanted = crash_silent_runs(args.heartbeat_s, args.missed)
    except ValueError as exc:
        parser.error(str(exc))
    automation_id = apply(wanted)
    window = wanted.trigger.within.total_seconds()  # type: ignore[union-attr]
    print(f"automation {wanted.name!r} ({automation_id}): Crashed after {window:.0f} s silent")


if __name__ == "__main__":
    main()
