"""Every deployment in prefect.yaml points at a real flow and its parameters validate."""

import pytest
from prefect.flows import Flow
from prefect.utilities.callables import parameter_schema

from deployments.catalog import deployments

ENTRIES = deployments()


def test_prefect_yaml_has_deployments():
    assert {e.name for e in ENTRIES} >= {"cpu-local"}


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.entrypoint + ":" + e.name for e in ENTRIES])
def test_entrypoint_imports_and_parameters_validate(entry):
    flow = entry.load_flow()
    assert isinstance(flow, Flow)
    flow.validate_parameters(entry.parameters)  # raises on a bad or unknown parameter
    schema = parameter_schema(flow.fn).model_dump()
    assert set(entry.parameters) <= set(schema["properties"])


def test_bad_parameters_are_rejected_naming_the_field():
    flow = next(e for e in ENTRIES if e.name == "cpu-local").load_flow()
    with pytest.raises(Exception, match="gpus"):
        flow.validate_parameters({"config": {"gpus": 0}})
    with pytest.raises(Exception, match="num_epoch"):
        flow.validate_parameters({"config": {"num_epoch": 3}})


def test_serve_builds_every_deployment_with_its_schedules():
    from deployments.serve import runner_deployments

    served = {(d.flow_name, d.name): d for d in runner_deployments()}
    assert set(served) == {(e.load_flow().name, e.name) for e in ENTRIES}
    nightly = served[("mlp", "cpu-local")].schedules
    assert len(nightly) == 1 and nightly[0].active is False  # off until a user turns it on
    assert nightly[0].schedule.cron == "0 3 * * *"
