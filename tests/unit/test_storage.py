"""A run's checkpoints in object storage, against a real S3 API: moto's server on loopback, the
stand-in for S3 (the same calls reach GCS or Azure through fsspec by configuration alone)."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import boto3
import pytest

from tests.conftest import REPO_ROOT
from trainflow import checkpoint, storage
from trainflow.paths import RUN_CONFIG_FILE

BUCKET = "runs"


@pytest.fixture
def bucket(s3_server, tmp_path, monkeypatch):
    """A bucket on the stand-in S3 server, and an empty temp dir that must stay empty."""
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=BUCKET)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    yield boto3.client("s3", endpoint_url=s3_server)
    # torch's compile cache (imported by the detection model) is torch's own, kept on purpose.
    left = [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == [], "temp files left behind"


def _keys(s3, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _checkpoint(root: Path, step: int, name: str | None = None) -> Path:
    """A complete checkpoint as the strategies publish one: shards in a subfolder, a rank's
    state, the marker."""
    path = root / name if name else checkpoint.checkpoint_path(root, step)
    partial = checkpoint.partial_path(path)
    (partial / "model").mkdir(parents=True)
    (partial / "model" / "__0_0.distcp").write_bytes(bytes(range(256)) * (step + 1))
    (partial / "rank_0.state.pt").write_bytes(f"state {step}".encode())
    checkpoint.publish(partial, path, step, technique="ddp")
    return path


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_checkpoint_goes_up_whole_and_comes_back_byte_for_byte(bucket, tmp_path):
    remote = f"s3://{BUCKET}/runs/mlp/run1/checkpoints"
    local = _checkpoint(tmp_path / "a" / "checkpoints", 7)
    assert storage.upload_checkpoint(local, remote) == f"{remote}/step_000007"
    prefix = "runs/mlp/run1/checkpoints/step_000007/"
    assert _keys(bucket, prefix) == [
        f"{prefix}meta.json",
        f"{prefix}model/__0_0.distcp",
        f"{prefix}rank_0.state.pt",
    ]
    assert storage.remote_checkpoints(remote) == [(7, "step_000007")]

    elsewhere = tmp_path / "b" / "checkpoints"
    got = storage.download_latest(remote, elsewhere)
    assert got == elsewhere / "step_000007"
    assert _files(got) == _files(local)
    assert checkpoint.latest_checkpoint(elsewhere) == got
    assert [p.name for p in elsewhere.iterdir()] == ["step_000007"]  # no partial folder left
    # A local checkpoint as new as the bucket's is not downloaded again.
    assert storage.download_latest(remote, elsewhere) is None


def test_a_checkpoint_in_the_bucket_without_its_marker_is_never_picked(bucket, tmp_path):
    remote = f"s3://{BUCKET}/runs/mlp/run2/checkpoints"
    root = tmp_path / "checkpoints"
    storage.upload_checkpoint(_checkpoint(root, 5), remote)
    storage.upload_checkpoint(_checkpoint(root, 10), remote)
    # An upload cut short: every file but the marker, which goes up last.
    bucket.delete_object(Bucket=BUCKET, Key="runs/mlp/run2/checkpoints/step_000010/meta.json")
    assert _keys(bucket, "runs/mlp/run2/checkpoints/step_000010/")  # its files are there

    assert storage.remote_checkpoints(remote) == [(5, "step_000005")]
    got = storage.download_latest(remote, tmp_path / "elsewhere")
    assert got is not None and checkpoint.read_meta(got)["step"] == 5


def test_the_bucket_keeps_the_newest_checkpoints_and_drops_uploads_cut_short(bucket, tmp_path):
    remote = f"s3://{BUCKET}/runs/sft/run3/checkpoints"
    root = tmp_path / "checkpoints"
    storage.upload_checkpoint(_checkpoint(root, 10, "checkpoint-10"), remote)
    storage.upload_checkpoint(_checkpoint(root, 20, "checkpoint-20"), remote)
    bucket.delete_object(Bucket=BUCKET, Key="runs/sft/run3/checkpoints/checkpoint-20/meta.json")
    for step in (30, 40):
        storage.upload_checkpoint(_checkpoint(root, step, f"checkpoint-{step}"), remote, keep=2)

    assert storage.remote_checkpoints(remote) == [(30, "checkpoint-30"), (40, "checkpoint-40")]
    folders = {k.split("/")[4] for k in _keys(bucket, "runs/sft/run3/checkpoints/")}
    assert folders == {"checkpoint-30", "checkpoint-40"}  # checkpoint-20's files went too


def test_a_run_resumed_elsewhere_gets_its_config_and_newest_checkpoint_from_the_bucket(
    bucket, tmp_path, monkeypatch
):
    """One machine starts the run and checkpoints; another, with nothing local, reads its
    config and newest complete checkpoint from the bucket, then uploads its own."""
    root = f"s3://{BUCKET}/runs"
    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path / "first"))
    first = storage.local_run_dir("mlp", "run4", root)
    assert first == tmp_path / "first" / "outputs" / "mlp" / "run4"
    first.mkdir(parents=True)
    (first / RUN_CONFIG_FILE).write_text(json.dumps({"num_epochs": 3, "output_root": root}))
    run_uri = storage.remote_run_uri("mlp", "run4", root)
    assert storage.open_run(run_uri, first, keep=1) is None  # a new run: nothing to fetch
    assert _keys(bucket, "runs/mlp/run4/") == ["runs/mlp/run4/config.json"]
    for step in (3, 6):
        storage.mirror_checkpoint(_checkpoint(first / "checkpoints", step))
    assert storage.remote_checkpoints(f"{run_uri}/checkpoints") == [(6, "step_000006")]

    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path / "second"))
    assert storage.read_run_config("mlp", "run4", root)["num_epochs"] == 3
    second = storage.local_run_dir("mlp", "run4", root)
    assert not second.exists()
    second.mkdir(parents=True)
    got = storage.open_run(run_uri, second, keep=1)
    assert got == second / "checkpoints" / "step_000006"
    assert _files(got) == _files(first / "checkpoints" / "step_000006")
    assert json.loads((second / RUN_CONFIG_FILE).read_text())["num_epochs"] == 3
    storage.mirror_checkpoint(_checkpoint(second / "checkpoints", 9))
    assert storage.remote_checkpoints(f"{run_uri}/checkpoints") == [(9, "step_000009")]
    # Continued with its output_root unset: kept locally only, nothing more goes up.
    storage.open_run(None, second, keep=1)
    storage.mirror_checkpoint(_checkpoint(second / "checkpoints", 12))
    assert storage.remote_checkpoints(f"{run_uri}/checkpoints") == [(9, "step_000009")]

    with pytest.raises(ValueError, match=r"no mlp run nosuch .*runs/mlp/nosuch/config\.json"):
        storage.read_run_config("mlp", "nosuch", root)


def test_a_local_output_root_keeps_the_run_folder_there(tmp_path):
    from trainflow.workloads.mlp import MLPConfig

    config = MLPConfig(output_root=str(tmp_path / "runs"))
    assert storage.local_run_dir("mlp", "r1", config.output_root) == tmp_path / "runs/mlp/r1"
    assert storage.remote_run_uri("mlp", "r1", config.output_root) is None
    folder = tmp_path / "runs" / "mlp" / "r1"
    folder.mkdir(parents=True)
    (folder / RUN_CONFIG_FILE).write_text('{"num_epochs": 2}')
    assert storage.read_run_config("mlp", "r1", config.output_root) == {"num_epochs": 2}
    with pytest.raises(ValueError, match="under this TRAINFLOW_HOME"):
        storage.read_run_config("mlp", "r1")


def _gcsfs_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("gcsfs") is None


@pytest.mark.parametrize(
    ("root", "names"),
    [
        ("nosuch://bucket/runs", ("unknown scheme 'nosuch'",)),
        pytest.param(
            "gs://bucket/runs",
            ("pip install gcsfs",),
            marks=pytest.mark.skipif(_gcsfs_missing() is False, reason="gcsfs is installed"),
        ),
        ("s3://", ("names no bucket",)),
    ],
)
def test_a_bad_output_root_is_a_usage_error_naming_it(root, names):
    proc = subprocess.run(
        [sys.executable, "-m", "flows.mlp", "--output-root", root],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--output-root" in proc.stderr and "output_root" in proc.stderr.replace(
        "--output-root", ""
    )
    for name in names:
        assert name in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_detection_reads_its_dataset_from_the_bucket_checking_every_shard(
    bucket, tmp_path, monkeypatch
):
    """The shapes dataset published to the stand-in S3 server reads as the same images as a
    local copy; a damaged cached copy is fetched again, a damaged shard in the bucket fails
    naming it."""
    import torch

    from trainflow.data import DataConfig, DataError, prepare_dataset
    from trainflow.data.paths import stream_cache_dir
    from trainflow.data.shapes import ShapesSpec, write_shapes
    from trainflow.workloads.detection import read_split

    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path / "home"))
    spec = ShapesSpec(num_classes=3, image_size=32, max_objects=3, min_object_size=8)
    files = write_shapes(tmp_path / "src", spec, {"train": 24, "validation": 8})

    def prepare(root: str) -> str:
        return prepare_dataset(
            DataConfig(
                name="shapes-s3",
                source={"kind": "files", "files": {s: [str(p)] for s, p in files.items()}},
                transform={"name": "detection", "num_classes": 3},
                compression=None,
                shard_size="16kb",
                output_root=root,
            )
        ).uri

    local, remote = prepare(str(tmp_path / "datasets")), prepare("s3://datasets/prepared")
    want = read_split(local, "train")

    def assert_same(got) -> None:
        assert len(got) == len(want) == 24
        for (image, target), (image_want, target_want) in zip(got, want, strict=True):
            assert torch.equal(image, image_want)
            assert torch.equal(target["boxes"], target_want["boxes"])
            assert torch.equal(target["labels"], target_want["labels"])

    assert_same(read_split(remote, "train"))
    cached = sorted((stream_cache_dir(remote) / "train").glob("shard.*.mds"))
    assert len(cached) > 1
    data = bytearray(cached[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    cached[0].write_bytes(bytes(data))
    assert_same(read_split(remote, "train"))  # fetched again from the bucket, not read
    assert not list((stream_cache_dir(remote) / "train").glob(".*.tmp"))

    key = f"{remote.removeprefix('s3://datasets/')}/train/{cached[1].name}"
    s3 = boto3.client("s3", endpoint_url=bucket.meta.endpoint_url)
    s3.put_object(Bucket="datasets", Key=key, Body=b"not the shard it was")
    cached[1].unlink()
    with pytest.raises(DataError, match=cached[1].name):
        read_split(remote, "train")


def test_a_bad_output_root_in_the_environment_is_a_usage_error_naming_the_variable():
    """TRAINFLOW_OUTPUT_ROOT (a team's shared default, set on its machines and pods) is checked
    before any config is built: exit 2, one line naming it, no traceback."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRAINFLOW_OUTPUT_ROOT": "nosuch://bucket/runs"}
    done = subprocess.run(
        [sys.executable, "-m", "flows.mlp", "--max-steps", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "TRAINFLOW_OUTPUT_ROOT" in done.stderr and "Traceback" not in done.stderr


def test_the_output_root_defaults_to_the_environments(monkeypatch):
    from trainflow.configs.mlp import MLPConfig

    monkeypatch.setenv("TRAINFLOW_OUTPUT_ROOT", "s3://team-bucket/runs/")
    assert MLPConfig().output_root == "s3://team-bucket/runs"
    monkeypatch.setenv("TRAINFLOW_OUTPUT_ROOT", "")
    assert MLPConfig().output_root is None
