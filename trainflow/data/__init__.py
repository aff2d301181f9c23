"""Data: prepare Hugging Face `datasets` sources as MDS shards, and stream them into ranks.

Library code only (no Prefect): `tasks/data.py` wraps `prepare_dataset` as a cached task.

The configs are imported here; the loader and `prepare_dataset` on first use, since they import
`datasets`, `transformers`, `streaming` and torch, which validating a config, `--help` and
`prepare_dataset`'s cache lookups in a flow process never need.
"""

import importlib
from typing import TYPE_CHECKING, Any

from trainflow.data.config import (
    ChatTransform,
    DataConfig,
    FileSource,
    HubSource,
    LoaderConfig,
    PreparedDataset,
    SplitInfo,
    TabularTransform,
    TextTransform,
    ValidationSplit,
    load_preset,
)
from trainflow.data.errors import DataError

if TYPE_CHECKING:
    from trainflow.data.loader import PadCollate, build_dataloader, read_whole_split
    from trainflow.data.prepare import (
        dataset_fingerprint,
        dataset_uri,
        find_published,
        prepare_dataset,
    )

_EXPORTS = {
    "PadCollate": "trainflow.data.loader",
    "build_dataloader": "trainflow.data.loader",
    "dataset_fingerprint": "trainflow.data.prepare",
    "dataset_uri": "trainflow.data.prepare",
    "find_published": "trainflow.data.prepare",
    "prepare_dataset": "trainflow.data.prepare",
    "read_whole_split": "trainflow.data.loader",
}

__all__ = [
    "ChatTransform",
    "DataConfig",
    "DataError",
    "FileSource",
    "HubSource",
    "LoaderConfig",
    "PadCollate",
    "PreparedDataset",
    "SplitInfo",
    "TabularTransform",
    "TextTransform",
    "ValidationSplit",
    "build_dataloader",
    "dataset_fingerprint",
    "dataset_uri",
    "find_published",
    "load_preset",
    "prepare_dataset",
    "read_whole_split",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainflow.data' has no attribute {name!r}")
