"""The launch spec the caller ships to the agent: typed, checked on both sides, versioned."""

import dataclasses
import json
import subprocess
import sys

import pytest

from trainflow.launch.run_dir import RunDir
from trainflow.launch.spec import SPEC_VERSION, LaunchSpec, LaunchSpecError


def _spec(**changes) -> LaunchSpec:
    fields = dict(
        function="train",
        run_id="abc",
        rdzv_endpoint="127.0.0.1:0",
        rdzv_timeout_s=900,
        rdzv_is_host=None,
        nnodes=1,
        min_nodes=1,
        nproc_per_node=2,
        device="cpu",
        max_restarts=0,
        shutdown_timeout_s=30,
        collective_timeout_s=600.0,
        hang_timeout_s=None,
        init_process_group=False,
        start_method="fork",
        sys_path=["/somewhere"],
        python=sys.executable,
        code_files=[["train", 1, "<cell>"]],
        env_names=["PYTHONPATH"],
        caller_pid=1,
    )
    return LaunchSpec(**(fields | changes))


def test_a_spec_reads_back_as_written():
    spec = _spec(hang_timeout_s=2.5, rdzv_is_host=True)
    assert LaunchSpec.from_json(spec.to_json()) == spec
    assert json.loads(spec.to_json())["version"] == SPEC_VERSION


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("nproc_per_node", "2"),
        ("init_process_group", 1),
        ("sys_path", "/x"),
        ("max_restarts", True),
    ],
)
def test_a_field_of_the_wrong_type_is_named_where_the_spec_is_made(field, value):
    with pytest.raises(LaunchSpecError, match=f"field '{field}'"):
        _spec(**{field: value})


def test_a_spec_of_another_version_is_refused_naming_both_versions():
    data = json.loads(_spec().to_json()) | {"version": SPEC_VERSION + 1}
    with pytest.raises(LaunchSpecError, match=rf"version {SPEC_VERSION + 1}.*{SPEC_VERSION}"):
        LaunchSpec.from_json(json.dumps(data))


def test_unknown_and_missing_fields_are_named():
    data = json.loads(_spec().to_json())
    data["renamed_field"] = data.pop("run_id")
    with pytest.raises(
        LaunchSpecError, match="unknown field 'renamed_field'.*missing field 'run_id'"
    ):
        LaunchSpec.from_json(json.dumps(data))


def test_a_wrong_type_in_the_file_is_named_where_it_is_read():
    data = json.loads(_spec().to_json()) | {"nnodes": "two"}
    with pytest.raises(LaunchSpecError, match="field 'nnodes'"):
        LaunchSpec.from_json(json.dumps(data))


def test_an_agent_given_a_spec_it_cannot_read_says_why_and_starts_no_rank(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.create(_spec(), b"")
    data = json.loads(rd.spec.read_text()) | {"version": SPEC_VERSION + 1}
    rd.spec.write_text(json.dumps(data))
    out = subprocess.run(
        [sys.executable, "-m", "trainflow.launch.agent", str(rd.path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert f"version {SPEC_VERSION + 1}" in rd.agent_error.read_text()
    assert rd.log_files() == {}


def test_the_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _spec().run_id = "other"  # type: ignore[misc]
