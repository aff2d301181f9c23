"""`--dry-run` plans a run without its GPUs, the hub or any server, and says if it fits.

This machine has no GPU and the hub is unreachable: the GPU presets are planned here as they
would be on a laptop.
"""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from trainflow.dryrun import plan_run
from trainflow.pipelines import PIPELINES


def _dry_run(cwd, pipeline: str, *args: str) -> subprocess.CompletedProcess:
    home = cwd / "home"
    return subprocess.run(
        [sys.executable, "-m", f"flows.{pipeline}", *args, "--dry-run"],
        cwd=cwd,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "MLFLOW_TRACKING_URI": "",
            "HF_HUB_OFFLINE": "1",
            "TRAINFLOW_HOME": str(home),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


def _nothing_started(cwd) -> None:
    """No MLflow store, no run folder, no Prefect home: nothing was started or written."""
    assert [p.name for p in cwd.iterdir()] in ([], ["home"])
    home = cwd / "home"
    assert not home.exists() or not any((home / d).exists() for d in ("runs", "outputs"))


def test_ddp_for_gpt_oss_120b_is_refused_naming_both_numbers(tmp_path):
    proc = _dry_run(tmp_path, "sft", "--preset", "gpt-oss-120b", "--technique", "ddp")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "python -m flows.sft: error: dry run: technique ddp needs an estimated" in proc.stderr
    assert "248.2 GB per GPU but 80.0 GB per GPU (H100 from the GPU table)" in proc.stderr
    assert "1 node(s) x 8 rank(s) of H100 GPUs" in proc.stdout
    assert "verdict: the run would NOT fit" in proc.stdout
    _nothing_started(tmp_path)


def test_auto_for_gpt_oss_120b_prints_the_choice_and_fits(tmp_path):
    proc = _dry_run(tmp_path, "sft", "--preset", "gpt-oss-120b", "--technique", "auto")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "candidate ddp:" in out and "does not fit" in out
    assert "auto -> fsdp (mixed_precision='bf16', activation_checkpointing=True)" in out
    assert "model names: checked at launch" in out  # the hub is not asked
    assert "verdict: the run would fit" in out
    _nothing_started(tmp_path)


def test_a_shipped_config_names_its_deployment_and_counts_its_rows(tmp_path):
    proc = _dry_run(tmp_path, "two_tower")
    assert proc.returncode == 0, proc.stderr
    assert "deployment two_tower/cpu-local on work pool cpu-local" in proc.stdout
    assert "train: 1 file(s), 20000 rows" in proc.stdout
    assert "config, files and names: passed" in proc.stdout
    _nothing_started(tmp_path)


def test_a_bad_file_is_named_and_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    config = PIPELINES["sft"].defaults().model_copy(update={"dataset": str(bad)})
    plan = plan_run(PIPELINES["sft"], config, detect=False)
    assert not plan.fits
    assert any(str(bad) in problem for problem in plan.problems), plan.problems


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_pipeline_plans_its_default_config(name):
    spec = PIPELINES[name]
    plan = plan_run(spec, spec.defaults(), detect=False)
    assert plan.fits, plan.problems
    assert {"placement", "checks", "where"} <= set(plan.sections)


def test_from_the_ui_the_dry_run_parameter_shows_the_plan_and_a_misfit_fails_the_run(
    prefect_api, tmp_path
):
    """What a run started from the UI with `dry_run: true` does: an artifact, no MLflow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from flows.sft import sft
    from trainflow import tracking

    fits = sft.with_options(flow_run_name="plan-fits")
    assert fits(PIPELINES["sft"].preset("gpt-oss-120b"), dry_run=True) is None
    misfit = PIPELINES["sft"].preset("gpt-oss-120b").model_copy(update={"technique": _ddp()})
    with pytest.raises(ValueError, match="technique ddp needs an estimated 248.2 GB per GPU"):
        sft.with_options(flow_run_name="plan-misfit")(misfit, dry_run=True)

    with get_client(sync_client=True) as client:
        for name, verdict in (("plan-fits", "would fit."), ("plan-misfit", "would NOT fit")):
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name]))
            )
            artifacts = {a.key: a for a in client.read_artifacts() if a.flow_run_id == runs[0].id}
            assert verdict in str(artifacts["sft-plan"].data)
    experiment = tracking.store_client().get_experiment_by_name("sft")
    assert experiment is None or not tracking.store_client().search_runs([experiment.experiment_id])


def _ddp():
    from trainflow.strategies import DDPConfig

    return DDPConfig()
