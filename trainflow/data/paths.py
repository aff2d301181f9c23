"""Where prepared datasets and streaming caches live on this machine."""

import hashlib
import os
from pathlib import Path

from trainflow.paths import trainflow_home


def default_datasets_root() -> str:
    """Default root under which prepared datasets are published: `$TRAINFLOW_DATASETS` (a
    local folder or an object store, `s3://bucket/prefix`, which a team's runs share), else
    `$TRAINFLOW_HOME/datasets`."""
    return os.environ.get("TRAINFLOW_DATASETS") or str(trainflow_home() / "datasets")


def hf_cache_dir() -> Path:
    """Arrow cache for `datasets` loads and maps, kept under the trainflow home."""
    return trainflow_home() / "hf-datasets"


def stream_cache_dir(uri: str) -> Path:
    """Local `streaming` cache for one published dataset.

    Deterministic (the same dataset reuses its cache across runs, ranks on a node share it) and
    unique per dataset URI (two datasets never share one, which `streaming` forbids).
    """
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    return trainflow_home() / "stream-cache" / digest


def is_remote(uri: str) -> bool:
    """Whether `uri` names object storage (`s3://...`) rather than a local path."""
    return "://" in uri


def join_uri(base: str, *parts: str) -> str:
    """Join path components onto a local path or a `scheme://` URI."""
    if is_remote(base):
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(base, *parts)
