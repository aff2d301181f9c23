"""A run kept in object storage, SIGKILLed, continues on another machine from its bucket.

`python -m flows.<name> --output-root s3://runs/runs` uploads each complete checkpoint; the
whole process group is SIGKILLed once one is in the bucket; `--resume RUN_ID --output-root ...`
under a new TRAINFLOW_HOME (another machine: no local run folder, the same MLflow store)
downloads it and continues from its step. The bucket is moto's S3 server on loopback, the
stand-in for S3: the same calls reach GCS or Azure through fsspec by configuration alone.
"""

import os
import signal
import time
from pathlib import Path

import boto3
import pytest

from tests.flows.test_resume import _logged_steps, _lose_the_machine, _run, _run_dir, _start
from tests.unit.conftest import s3_server  # noqa: F401 - the stand-in S3 server fixture
from trainflow import checkpoint, tracking
from trainflow.paths import trainflow_home

pytestmark = pytest.mark.slow

BUCKET = "runs"
ROOT = f"s3://{BUCKET}/runs"


@pytest.fixture
def s3(request):
    """A client of the stand-in S3 server (its endpoint and keys in the environment, which the
    runs inherit), with the bucket `runs`."""
    client = boto3.client("s3", endpoint_url=request.getfixturevalue("s3_server"))
    client.create_bucket(Bucket=BUCKET)
    return client


def _bucket_steps(s3, pipeline: str, run_id: str) -> list[int]:
    """Steps of the complete checkpoints in the bucket (those whose marker is there)."""
    prefix = f"runs/{pipeline}/{run_id}/checkpoints/"
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    steps = [checkpoint.step_of(k.split("/")[-2]) for k in keys if k.endswith("/meta.json")]
    return sorted(s for s in steps if s is not None)


def _kill_once_in_the_bucket(s3, pipeline: str, args: list[str]) -> tuple[str, int]:
    """Start the run, SIGKILL its whole process group once a checkpoint is in the bucket;
    return its run id and the newest complete checkpoint's step there."""
    first = _start(pipeline, *args, "--output-root", ROOT)
    run_id = _run_dir(pipeline, first).name
    try:
        deadline = time.monotonic() + 300
        while not _bucket_steps(s3, pipeline, run_id):
            assert first.poll() is None, first.stdout.read()[-5000:]
            assert time.monotonic() < deadline, "no checkpoint reached the bucket"
            time.sleep(0.2)
        _lose_the_machine(first)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    steps = _bucket_steps(s3, pipeline, run_id)
    # keep_checkpoints: the bucket is pruned as well, the oldest once the newest is up; a kill
    # between the two (a loaded machine widens it) leaves one more, which the resume prunes.
    assert steps and len(steps) <= 3
    return run_id, steps[-1]


def _another_machine(monkeypatch, tmp_path: Path, pipeline: str, run_id: str) -> Path:
    """A TRAINFLOW_HOME with no trace of the run; returns where its run folder will be."""
    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path / "another-machine"))
    run_dir = trainflow_home() / "outputs" / pipeline / run_id
    assert not run_dir.exists()
    return run_dir


def _new_tmp_entries_of(run_id: str, before: set[str]) -> list[str]:
    """What appeared in /tmp during the test and holds the run's files."""
    found = []
    for name in sorted(set(os.listdir("/tmp")) - before):
        path = Path("/tmp") / name
        if run_id in name or (
            path.is_dir()
            and any(run_id in str(p) or p.name == ".mirror.json" for p in path.rglob("*"))
        ):
            found.append(name)
    return found


def test_mlp_killed_resumes_on_another_machine_from_its_checkpoint_in_the_bucket(
    prefect_api, s3, tmp_path, monkeypatch
):
    tmp_before = set(os.listdir("/tmp"))
    name = "mlp-object-storage"
    args = [
        *("--max-steps", "300", "--checkpoint-every", "20", "--log-every", "5"),
        *("--registered-model-name", name, "--learning-rate", "0.003"),
    ]
    run_id, resumed_at = _kill_once_in_the_bucket(s3, "mlp", args)
    assert resumed_at < 300, "the run ended before it was killed"
    assert s3.get_object(Bucket=BUCKET, Key=f"runs/mlp/{run_id}/config.json")

    run_dir = _another_machine(monkeypatch, tmp_path, "mlp", run_id)
    out = _run("mlp", "--resume", run_id, "--output-root", ROOT)
    latest = checkpoint.checkpoint_path(run_dir / "checkpoints", resumed_at)
    assert f"downloaded checkpoint {latest.name} from {ROOT}/mlp/{run_id}" in out
    assert f"resumed from {latest} at step {resumed_at}" in out
    client = tracking.store_client()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["max_steps"] == "300"  # its own config, read from the bucket
    assert len(client.search_runs([run.info.experiment_id])) == 1
    steps = _logged_steps(client, run_id, "train_loss")
    assert steps == sorted(set(range(5, steps[-1] + 1, 5)) | {steps[-1]})  # no gap
    # The resumed run's own checkpoints went up too, up to the last step.
    final = checkpoint.read_meta(checkpoint.latest_checkpoint(run_dir / "checkpoints"))["step"]
    in_bucket = _bucket_steps(s3, "mlp", run_id)
    assert in_bucket[-1] == final == 300
    assert len(in_bucket) <= 2  # the leftover of the kill went too
    assert _new_tmp_entries_of(run_id, tmp_before) == []


def test_sft_killed_resumes_on_another_machine_from_its_trainer_checkpoint_in_the_bucket(
    prefect_api, s3, tmp_path, monkeypatch
):
    """The issue's case: the Hugging Face Trainer's `checkpoint-N` folders, uploaded by rank 0
    once every rank saved, continue the run elsewhere."""
    name = "sft-object-storage"
    args = [
        *("--max-steps", "60", "--checkpoint-every", "20", "--training-logging-steps", "10"),
        *("--evaluation-num-samples", "32", "--evaluation-max-new-tokens", "8"),
        *("--registered-model-name", name),
    ]
    run_id, resumed_at = _kill_once_in_the_bucket(s3, "sft", args)
    assert resumed_at < 60, "the run ended before it was killed"

    run_dir = _another_machine(monkeypatch, tmp_path, "sft", run_id)
    resumed_from_ms = time.time() * 1000
    out = _run("sft", "--resume", run_id, "--output-root", ROOT)
    latest = run_dir / "checkpoints" / f"checkpoint-{resumed_at}"
    assert f"downloaded checkpoint {latest.name} from {ROOT}/sft/{run_id}" in out
    assert f"resuming from {latest} at step {resumed_at}" in out
    client = tracking.store_client()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "train_loss")
    after = sorted(m.step for m in history if m.timestamp >= resumed_from_ms)
    assert after[0] == resumed_at + 10  # trained on from the bucket's step, not from 0
    assert _logged_steps(client, run_id, "train_loss") == list(range(10, 61, 10))
    assert _bucket_steps(s3, "sft", run_id)[-1] == 60
    assert [v.run_id for v in client.search_model_versions(f"name='{name}'")] == [run_id]
