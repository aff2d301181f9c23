"""Data: prepare Hugging Face `datasets` sources as MDS shards, and stream them into ranks.

Library code only (no Prefect): `tasks/data.py` wraps `prepare_dataset` as a cached task.
"""

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
from trainflow.data.loader import PadCollate, build_dataloader
from trainflow.data.prepare import dataset_uri, find_published, prepare_dataset

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
    "dataset_uri",
    "find_published",
    "load_preset",
    "prepare_dataset",
]
