"""Fixtures of the unit tests that need a service: an S3-compatible server."""

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import free_port, wait_until_serving


@pytest.fixture
def s3_server(monkeypatch, tmp_path):
    """A real S3-compatible server (moto) on loopback, with a bucket 'datasets'."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    endpoint = f"http://127.0.0.1:{port}"
    wait_until_serving(endpoint, proc, 60, "moto server")
    for key, value in {
        "S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="datasets")
    try:
        yield endpoint
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
