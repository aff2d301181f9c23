"""Data throughput: MDS vs Arrow reads, and conversion through the task vs a plain MDSWriter loop.

    python benchmarks/data_throughput.py [--rows 20000]

Prints one JSON line (samples/s; higher is better):
- read_mds_sps: iterating the prepared split with `build_dataloader` (batch 64, one process,
  best of 3 passes);
- read_arrow_sps: the same rows and columns as a `datasets` Arrow table through a torch
  `DataLoader` with the same `PadCollate` (batch 64, one process, best of 3 passes);
- convert_task_sps: JSONL -> chat tokens -> published MDS through the `prepare-dataset` Prefect
  task with its defaults (one process per core; cache refreshed, so it does the work), timed
  around the task call inside its flow: the Prefect server's start-up and the flow run's own
  start and end are a pipeline's fixed cost, not conversion (`benchmarks/cold_start.py`
  measures those), and the plain loop has neither;
- convert_plain_sps: the same rows through a plain one-process loop of batched
  `apply_chat_template` (assistant mask from the template's generation markers) and
  `MDSWriter.write` with the task's compression, shard size and hashes; the run stops if the
  two wrote different samples;
- read_mds_over_arrow, convert_task_over_plain: the ratios, measured side by side in this run.
Everything runs in a temporary TRAINFLOW_HOME and PREFECT_HOME.
"""

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# Conversations per tokenizer call in the plain loop (the task's map batches 1000 as well).
PLAIN_BATCH = 1000


def _best_rate(loader: Iterable[dict[str, Any]], repeats: int = 3) -> float:
    """Best samples/s over `repeats` full passes (the machine may be shared)."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        count = sum(len(batch["id"]) for batch in loader)
        rates.append(count / (time.perf_counter() - start))
    return max(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000, help="instruction rows to convert")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="trainflow-bench-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    os.environ["TRAINFLOW_HOME"] = str(scratch / "home")
    os.environ["PREFECT_HOME"] = str(scratch / "prefect")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    sys.path.insert(0, str(REPO_ROOT))

    import datasets
    import numpy as np
    from prefect import flow
    from streaming import MDSWriter, StreamingDataset
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from tasks.data import _prepare_dataset
    from trainflow.data import DataConfig, FileSource, LoaderConfig, PadCollate, build_dataloader
    from trainflow.data.synthetic import instruction_rows, write_jsonl

    datasets.disable_progress_bars()
    tokenizer_dir = str(REPO_ROOT / "data" / "tokenizer")
    source = scratch / "instructions.jsonl"
    rows = instruction_rows(args.rows, seed=1)
    write_jsonl(rows, source)
    config = DataConfig.model_validate(
        {
            "name": "bench",
            "source": {"kind": "files", "files": {"train": [str(source)]}},
            "id_column": "id",
            "transform": {"name": "chat", "tokenizer": tokenizer_dir},
        }
    )

    @flow(name="bench-prepare")
    def run_task(cfg: DataConfig) -> tuple[Any, float]:
        start = time.perf_counter()
        prepared = _prepare_dataset.with_options(refresh_cache=True)(cfg)
        return prepared, time.perf_counter() - start

    # Start Prefect's server first, on other rows so that no map result can be reused.
    warmup = scratch / "warmup.jsonl"
    write_jsonl(instruction_rows(100, seed=2), warmup)
    run_task(config.model_copy(update={"source": FileSource(files={"train": [str(warmup)]})}))
    result, took = run_task(config.model_copy(update={"output_root": str(scratch / "task")}))
    convert_task = args.rows / took

    # The task's work, written by hand: the same rows, the same batched chat-template
    # tokenization and answer masks, columns, compression, shard size and shard hashes.
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    columns = {"id": "int64", "input_ids": "ndarray:int32", "assistant_masks": "ndarray:uint8"}
    start = time.perf_counter()
    lines = source.read_text().splitlines()
    with MDSWriter(
        out=str(scratch / "plain"),
        columns=columns,
        compression=config.compression,
        hashes=config.hashes,
        size_limit=config.shard_size,
    ) as writer:
        for first in range(0, len(lines), PLAIN_BATCH):
            batch = [json.loads(line) for line in lines[first : first + PLAIN_BATCH]]
            encoded = tokenizer.apply_chat_template(
                [row["messages"] for row in batch],
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            for row, ids, mask in zip(
                batch, encoded["input_ids"], encoded["assistant_masks"], strict=True
            ):
                writer.write(
                    {
                        "id": row["id"],
                        "input_ids": np.asarray(ids, np.int32),
                        "assistant_masks": np.asarray(mask, np.uint8),
                    }
                )
    convert_plain = args.rows / (time.perf_counter() - start)

    loader = build_dataloader(result.uri, "train", LoaderConfig(batch_size=64, shuffle=False))
    read_mds = _best_rate(loader)

    # The very same rows and columns as an Arrow table, through the same collate into tensors.
    mds = StreamingDataset(local=str(Path(result.uri) / "train"), batch_size=64)
    samples = [mds[i] for i in range(mds.num_samples)]
    plain = StreamingDataset(local=str(scratch / "plain"), batch_size=64)
    if plain.num_samples != len(samples) or any(
        not all(np.array_equal(plain[i][c], s[c]) for c in columns) for i, s in enumerate(samples)
    ):
        raise SystemExit("the plain loop and the task wrote different samples: not the same work")
    arrow = datasets.Dataset.from_dict(
        {c: [s[c].tolist() if c != "id" else int(s[c]) for s in samples] for c in columns}
    ).with_format("numpy")
    arrow_loader = DataLoader(arrow, batch_size=64, collate_fn=PadCollate())
    read_arrow = _best_rate(arrow_loader)

    print(
        json.dumps(
            {
                "benchmark": "data_throughput",
                "rows": args.rows,
                "read_mds_sps": round(read_mds),
                "read_arrow_sps": round(read_arrow),
                "read_mds_over_arrow": round(read_mds / read_arrow, 3),
                "convert_task_sps": round(convert_task),
                "convert_plain_sps": round(convert_plain),
                "convert_task_over_plain": round(convert_task / convert_plain, 3),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
