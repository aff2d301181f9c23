"""Helpers shared by the data tests: small real datasets, configs and rank functions.

Rank functions live here (an importable module) so the launcher's ranks can unpickle them.
"""

import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from trainflow.data import DataConfig, LoaderConfig, build_dataloader
from trainflow.data.synthetic import instruction_rows, interaction_rows, write_csv, write_jsonl

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(REPO_ROOT / "data" / "tokenizer")


def chat_config(tmp_path: Path, num_rows: int = 200, **overrides: Any) -> DataConfig:
    """A chat dataset of `num_rows` shipped-style instructions, published under tmp_path."""
    path = tmp_path / "chat.jsonl"
    write_jsonl(instruction_rows(num_rows, seed=1), path)
    raw: dict[str, Any] = {
        "name": "chat",
        "source": {"kind": "files", "files": {"train": [str(path)]}},
        "id_column": "id",
        "transform": {"name": "chat", "tokenizer": TOKENIZER, "keep_columns": {"task": "str"}},
        "output_root": str(tmp_path / "out"),
    }
    raw.update(overrides)
    return DataConfig.model_validate(raw)


def tabular_config(tmp_path: Path, num_rows: int = 200, **overrides: Any) -> DataConfig:
    """A user-item clicks dataset of `num_rows` rows, published under tmp_path."""
    path = tmp_path / "clicks.csv"
    write_csv(interaction_rows(num_rows, seed=1), path)
    raw: dict[str, Any] = {
        "name": "clicks",
        "source": {"kind": "files", "files": {"train": [str(path)]}},
        "id_column": "id",
        "transform": {
            "name": "tabular",
            "columns": {"user_id": "int64", "item_id": "int64", "clicked": "float32"},
        },
        "output_root": str(tmp_path / "out"),
    }
    raw.update(overrides)
    return DataConfig.model_validate(raw)


def batch_ids(loader: Any, num_batches: int | None = None) -> list[list[int]]:
    """Ids of each batch the loader yields (at most `num_batches`)."""
    return [batch["id"].tolist() for batch in itertools.islice(loader, num_batches)]


def interleave(per_rank: list[list[list[int]]]) -> list[int]:
    """The global sample order from per-rank batches (streaming deals samples round-robin)."""
    order: list[int] = []
    for batches in zip(*per_rank, strict=True):
        for samples in zip(*batches, strict=True):
            order.extend(samples)
    return order


def read_epoch_then_resume(
    uri: str, split: str, config: LoaderConfig, num_batches: int
) -> dict[str, Any]:
    """On each rank: a full epoch, then `num_batches` and the state, then a resume from it."""
    full = build_dataloader(uri, split, config)
    epoch = batch_ids(full)
    del full
    partial = build_dataloader(uri, split, config)
    head = batch_ids(partial, num_batches)
    state = partial.state_dict()
    del partial
    resumed = build_dataloader(uri, split, config, state=state)
    tail = batch_ids(resumed)
    return {"epoch": epoch, "head": head, "state": state, "tail": tail}


def crash_reader_then_open_plainly(uri: str, split: str) -> None:
    """Leave a crashed reader's state behind, then open the split with plain `streaming`.

    A forked child in its own session builds a loader and is killed with its process group (as
    an OOM kill or a launcher stop does; Python's resource tracker dies with it). This process
    then builds a plain `StreamingDataset` on the same split and prints the outcome.
    """
    from streaming import StreamingDataset

    from trainflow.data.paths import stream_cache_dir

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        loader = build_dataloader(uri, split, LoaderConfig(batch_size=4))
        os.write(write_end, b"ready")
        signal.pause()
        del loader
    assert os.read(read_end, 5) == b"ready"
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    try:
        StreamingDataset(remote=uri, local=str(stream_cache_dir(uri)), split=split, batch_size=4)
        print("opened", flush=True)
    except ValueError as err:
        print(f"refused: {err}", flush=True)


def prepare_and_die_mid_write(config_json: str, after_samples: int) -> None:
    """Prepare a dataset but SIGKILL this process after writing `after_samples` samples."""
    from streaming import MDSWriter

    from trainflow.data import prepare_dataset

    original = MDSWriter.write
    written = 0

    def write_then_die(self: MDSWriter, sample: dict[str, Any]) -> None:
        nonlocal written
        written += 1
        if written > after_samples:
            os.kill(os.getpid(), signal.SIGKILL)
        original(self, sample)

    MDSWriter.write = write_then_die  # type: ignore[method-assign]
    prepare_dataset(DataConfig.model_validate_json(config_json))


def run_python(code: str, **popen: Any) -> "subprocess.Popen[str]":
    """Start `python -c code` from the repo root, in its own process group."""
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        text=True,
        start_new_session=True,
        **popen,
    )
