"""Start a pipeline's deployment on the hardware its config asks for.

The config's `gpus`, `gpu_type` and `nnodes` pick the hardware profile (work pool, GPU request,
node selector) before the run is created; the target deployment's server-side schema then
validates the parameters, so a bad config never reaches a worker.

    python -m flows.launch mlp --config '{"gpus": 8, "gpu_type": "H100"}'
"""

import argparse
import json
import sys
from typing import Any, Literal, cast

from prefect import flow
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from pydantic import BaseModel, Field

from deployments.catalog import deployments
from deployments.profiles import requested_size, select_profile

# Every flow that prefect.yaml deploys, by flow function name (file and flow share the name).
PIPELINES = tuple(sorted({e.entrypoint.rpartition(":")[2] for e in deployments()}))
Pipeline = Literal[PIPELINES]  # type: ignore[valid-type]


class LaunchedRun(BaseModel):
    """The flow run created for the pipeline."""

    deployment: str = Field(description="Deployment that runs the pipeline (flow/name).")
    flow_run_id: str = Field(description="Id of the created flow run.")
    job_variables: dict[str, Any] = Field(description="Sizing passed to the work pool.")


@flow(name="launch")
def launch(
    pipeline: Pipeline = "mlp",
    config: dict[str, Any] = {},  # noqa: B006 - Prefect parameters are copied per run
    wait: bool = False,
) -> LaunchedRun:
    """Run `pipeline` with `config` on the deployment of the profile its size selects.

    Args:
        pipeline: The pipeline (flow name) to run.
        config: The pipeline's config; `gpus`, `gpu_type` and `nnodes` choose the hardware.
        wait: Wait for the pipeline run to finish instead of returning once it is created.
    """
    profile = select_profile(*requested_size(config))
    name = f"{pipeline}/{profile.deployment}"
    # Called from a sync flow, Prefect's dual sync/async API returns the flow run itself.
    run = cast(
        FlowRun,
        run_deployment(
            name,
            parameters={"config": config},
            job_variables=profile.job_variables,
            timeout=None if wait else 0,
            as_subflow=True,
        ),
    )
    return LaunchedRun(
        deployment=name, flow_run_id=str(run.id), job_variables=profile.job_variables
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m flows.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("pipeline", choices=PIPELINES, help="Pipeline to run.")
    parser.add_argument("--config", type=json.loads, default={}, help="Pipeline config (JSON).")
    parser.add_argument("--wait", action="store_true", help="Wait for the run to finish.")
    args = parser.parse_args(sys.argv[1:])
    print(launch(args.pipeline, args.config, args.wait))
