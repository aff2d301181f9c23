"""Every registered pipeline is whole: flow, config, presets, deployments, sweep entry, docs.

A pipeline added to `trainflow.pipelines.PIPELINES` without one of them fails here, naming it.
"""

import inspect
from pathlib import Path

import pytest

from deployments.catalog import deployments
from flows import command
from flows.sweep import SweepConfig
from trainflow.pipelines import PIPELINES, PipelineSpec

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted(PIPELINES.values(), key=lambda s: s.name)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_the_flow_file_runs_the_spec_and_takes_its_config(spec: PipelineSpec):
    flow = command.flow_of(spec)
    assert flow.name == spec.name
    params = inspect.signature(flow.fn).parameters
    assert params["config"].annotation is spec.config_class()
    assert params["dry_run"].default is False
    assert spec.defaults() == params["config"].default


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_preset_validates_and_the_default_one_exists(spec: PipelineSpec):
    for name in spec.preset_names():
        assert isinstance(spec.preset(name), spec.config_class())
    if spec.default_preset is not None:
        assert spec.default_preset in spec.preset_names()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_deployments_are_the_presets_they_name(spec: PipelineSpec):
    """prefect.yaml repeats a preset's values (Prefect reads no other file): held equal here."""
    mine = {e.name: e for e in deployments() if e.entrypoint == spec.entrypoint}
    assert mine, f"{spec.name}: no deployment in prefect.yaml"
    assert set(mine) == set(spec.deployments), f"{spec.name}: spec and prefect.yaml disagree"
    for name, preset in spec.deployments.items():
        if preset is None:
            continue
        deployed = spec.config_class().model_validate(mine[name].parameters["config"])
        assert deployed == spec.preset(preset), f"{spec.name}/{name} differs from {preset}.yaml"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_pipeline_can_be_swept_toward_its_own_metric(spec: PipelineSpec):
    sweep = SweepConfig(pipeline=spec.name, space={"max_restarts": [0, 1]}, budget=8)
    assert (sweep.metric, sweep.mode) == (spec.sweep_metric, spec.sweep_mode)
    assert sweep.trial_config({"max_restarts": 1}).max_restarts == 1
    assert spec.sweep_metric in spec.summary_metrics or not spec.summary_metrics


def test_a_sweep_of_an_unknown_pipeline_names_the_registered_ones():
    with pytest.raises(ValueError, match="unknown pipeline 'nope'; known: mlp"):
        SweepConfig(pipeline="nope", space={"checkpoint_every": [1]})


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_pipeline_has_its_row_in_the_readme_and_the_pipeline_docs(spec: PipelineSpec):
    readme = (ROOT / "README.md").read_text()
    assert f"`python -m flows.{spec.name}" in readme, f"README lacks a row for {spec.name}"
    pipelines_md = (ROOT / "docs" / "pipelines.md").read_text()
    assert f"| `{spec.name}` |" in pipelines_md, f"docs/pipelines.md lacks a row for {spec.name}"
