"""`remote_call`: run a `@distributed(..., remote=True)` call on a worker's machine.

A deployment of this flow on a work pool with GPU workers is what `remote=True` submits to: the
caller pickles its function and arguments, and names the deployment in
TRAINFLOW_REMOTE_DEPLOYMENT (or TRAINFLOW_REMOTE_DEPLOYMENT_<GPU TYPE>). The flow launches the
ranks on the worker's machine like a local call, with rank logs in the run's logs, and returns
the per-rank values, pickled, through the result storage the caller reads.

It runs whatever code it is sent: give only trusted people the right to run the deployment.

    prefect deploy --name remote-call/cpu-local    # from prefect.yaml
    TRAINFLOW_REMOTE_DEPLOYMENT=remote-call/cpu-local python my_notebook_script.py
"""

import base64
from typing import Any

import cloudpickle
from prefect import flow

from trainflow.launch.backends import launch_in_prefect
from trainflow.launch.spec import LaunchOptions


@flow(name="remote-call", persist_result=True)
def remote_call(payload: str = "", options: dict[str, Any] | None = None) -> str:
    """Launch the pickled call (base64) with these `LaunchOptions`; per-rank values, pickled."""
    if not payload or not options:
        raise ValueError(
            "remote_call runs what a `@distributed(..., remote=True)` call sends it (payload "
            "and options); it is not meant to be started by hand"
        )
    fn, args, kwargs = cloudpickle.loads(base64.b64decode(payload))
    settings = LaunchOptions(**{**options, "remote": False})
    result = launch_in_prefect(fn, args, kwargs, settings)
    return base64.b64encode(cloudpickle.dumps(result.values)).decode()
