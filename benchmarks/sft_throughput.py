"""SFT training throughput: the pipeline's training step vs a plain `torchrun` + `SFTTrainer`.

Both sides do the same work: the same tiny Llama (same seed), the same rows in the same
order, the same tokens, answer-only labels and padding (TRL's collator pads each batch to its
longest row), the same Trainer settings (every one that shapes the optimisation: checked,
see `SAME_SETTINGS_EXCEPT`), the same steps, on 2 ranks.

- Pipeline: `trainflow.workloads.sft.train` under our launcher with DDP, reading the prepared
  MDS shards (each rank streams its own partition) and logging to a real MLflow run from
  rank 0. Each rank records the sample ids of every batch it trained on.
- Plain: a script under `torchrun` that loads those rows, already tokenized, from a JSONL
  file (rank 0's batches, then rank 1's), streams it as an iterable dataset with one shard
  per rank, and hands it to `SFTTrainer`, which builds the labels from `assistant_masks`.

Tokens/s counts non-padding tokens (TRL's `num_tokens`, summed over the ranks) per second of
the Trainer's `train_runtime` (start-up excluded) on both sides. Neither side writes a
checkpoint (the Trainer would time a run's last one). The pipeline's loader reads its next
batches in a thread while the rank trains (`LoaderConfig.prefetch`); the plain Trainer reads
each batch in its loop, as a plain script does.

`--busy-core` keeps one core busy with a spinning process beside both sides for the whole
comparison: the ranks then share the machine with other work, as on a slower or loaded
machine, where costs beside the training step (a thread reading ahead, a collective per step)
weigh more.

The sides run alternately, `--repeats` times each, and the fastest run of each counts
(`pipeline_vs_plain`), so that other work on the machine weighs on both alike; on a shared
2-core machine single runs of either side spread by 15 % or more, so the median of the
alternating pairs' ratios is printed beside it (`pipeline_vs_plain_median`). Prints one JSON
line::

    python -m benchmarks.sft_throughput [--steps 60] [--gpus 2] [--repeats 5] [--busy-core]
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_IDS = "sample_ids_rank{rank}.json"
FIRST_BATCH = "first_batch_rank{rank}.pt"
# Trainer settings allowed to differ: where files go, how many checkpoints the pipeline would
# keep (neither side writes one), how the pipeline feeds its own loader, and how the plain side
# tells TRL its rows carry assistant masks.
SAME_SETTINGS_EXCEPT = frozenset(
    {
        "output_dir",
        "logging_dir",
        "run_name",
        "save_total_limit",
        "ignore_data_skip",
        "dataset_kwargs",
        "accelerator_config",
        "assistant_only_loss",
        "ddp_backend",
    }
)


def plain(steps: int, rows_file: str, out: str, dump_first_batch: bool) -> None:
    """Rank body of the plain script (run by torchrun): SFTTrainer on pre-tokenized rows."""
    import datasets
    import torch
    from trl import SFTConfig, SFTTrainer

    from trainflow.data.tokenizer import load_tokenizer
    from trainflow.models.causal_lm import build_causal_lm
    from trainflow.workloads.sft import load_sft_preset

    config = load_sft_preset("debug_cpu")
    t, opt = config.training, config.training.optimizer
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_cpu = os.environ.get("TRAINFLOW_DEVICE", "cpu") == "cpu"
    tokenizer = load_tokenizer(str(REPO_ROOT / "data" / "tokenizer"))
    model = build_causal_lm(config.model, tokenizer, seed=t.seed)
    rows = datasets.load_dataset("json", data_files=rows_file, split="train")
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(dir=out),  # removed with the benchmark's folder
        max_steps=steps,
        per_device_train_batch_size=t.per_device_batch_size,
        gradient_accumulation_steps=t.grad_accum_steps,
        learning_rate=opt.learning_rate,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        adam_epsilon=opt.eps,
        warmup_steps=t.warmup_steps,
        lr_scheduler_type=t.lr_scheduler,
        logging_steps=t.logging_steps,
        seed=t.seed,
        data_seed=t.seed,
        save_strategy="no",
        report_to=[],
        max_length=config.max_length,
        dataloader_num_workers=0,
        disable_tqdm=True,
        # The pipeline counts the run's tokens into the Trainer's state (one more all-reduce a
        # step): the same work here.
        include_num_input_tokens_seen="non_padding",
        use_cpu=on_cpu,
        ddp_backend="gloo" if on_cpu else "nccl",
        ddp_bucket_cap_mb=25,
        ddp_find_unused_parameters=False,
        # Each rank reads its own shard of the stream, as the pipeline's ranks do.
        accelerator_config={"dispatch_batches": False},
    )
    settings = args.to_dict()  # as written: the Trainer fills in some defaults itself
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=rows.to_iterable_dataset(num_shards=world),
        processing_class=tokenizer,
    )
    if dump_first_batch:
        first = next(iter(trainer.get_train_dataloader()))
        torch.save(dict(first), Path(out) / FIRST_BATCH.format(rank=rank))
    output = trainer.train()
    # As a torchrun script should.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if rank == 0:
        tokens = max(h.get("num_tokens", 0.0) for h in trainer.state.log_history)
        (Path(out) / "plain.json").write_text(
            json.dumps(
                {
                    "tokens": tokens,
                    "runtime_s": output.metrics["train_runtime"],
                    "settings": settings,
                },
                default=str,
            )
        )


def recorded_train(job: Any, strategy: Any, **kwargs: Any) -> Any:
    """`sft.train` on this rank, recording the sample ids of every batch it trained on."""
    from trainflow import runtime
    from trainflow.workloads import sft

    sft.sample_log.start()
    result = sft.train(job, strategy, **kwargs)
    ids = Path(kwargs["output_dir"]) / SAMPLE_IDS.format(rank=runtime.get_global_rank())
    ids.write_text(json.dumps(sft.sample_log.ids))
    return result


def pipeline_config(steps: int, gpus: int) -> Any:
    """The debug preset with `steps` optimizer steps on `gpus` ranks, without checkpoints.

    The plain script writes none, and the Trainer writes a run's last checkpoint inside its
    `train_runtime`: with the preset's `checkpoint_every` the pipeline would time a checkpoint
    (model, optimizer, RNG streams) that the plain side never writes.
    """
    from trainflow.workloads import sft

    preset = sft.load_sft_preset("debug_cpu").model_dump()
    return sft.SFTConfig.model_validate(
        preset | {"max_steps": steps, "gpus": gpus, "checkpoint_every": 0}
    )


def pipeline_step(steps: int, gpus: int) -> dict[str, Any]:
    """The pipeline's training step: prepared shards, our launcher, DDP, rank-0 MLflow sink."""
    from trainflow import launch
    from trainflow.data import prepare_dataset
    from trainflow.paths import trainflow_home
    from trainflow.strategies.job import Workload, run_on_rank
    from trainflow.tracking import pipeline_run
    from trainflow.workloads import sft

    config = pipeline_config(steps, gpus)
    data = prepare_dataset(config.data_config())
    with pipeline_run("sft-benchmark", "throughput", params={}) as run_id:
        output_dir = trainflow_home() / "outputs" / "sft-benchmark" / run_id
        workload = Workload(
            train_fn="benchmarks.sft_throughput:recorded_train",
            model_fn=sft.build_model,
            config=sft.SFTJob(config=config, data=data),
            output_dir=str(output_dir),
            framework="hf",
            mlflow_run_id=run_id,
        )
        result = launch(
            run_on_rank,
            (workload, config.technique),
            options=config.resources.launch_options(),
            on_line=lambda rank, line: print(f"[rank {rank}] {line}", file=sys.stderr),
        ).values[0]
    m = result.metrics
    batches = [
        json.loads((output_dir / SAMPLE_IDS.format(rank=r)).read_text()) for r in range(gpus)
    ]
    return {
        "tokens": m["train_num_tokens"],
        "runtime_s": m["train_runtime"],
        "data_wait_share": m["eff_data_wait_share"],
        "logging_s": m["train_logging_s"],
        "batches": batches,
        "data_uri": data.uri,
    }


def train_rows(uri: str) -> dict[int, dict[str, Any]]:
    """Every row of the prepared train split by sample id, as the pipeline's loader gives it."""
    from trainflow.data import read_whole_split

    return {int(s["id"]): s for s in read_whole_split(uri, "train")}


def write_plain_rows(
    rows: dict[int, dict[str, Any]], batches: list[list[list[int]]], path: Path
) -> None:
    """The rows each rank trained on, tokenized, in its order: rank 0's batches, then rank 1's.

    Raises:
        ValueError: a rank trained on a short batch (the end of an epoch): the plain side
            re-batches its shard in full batches, so it could not train on the same batches.
    """
    sizes = {len(batch) for rank in batches for batch in rank}
    if len(sizes) != 1:
        raise ValueError(
            f"batch sizes {sorted(sizes)}: the steps run past the end of an epoch; use fewer"
        )
    with path.open("w") as f:
        for rank in batches:
            for batch in rank:
                for i in batch:
                    row = rows[i]
                    line = {
                        "input_ids": row["input_ids"].tolist(),
                        "assistant_masks": row["assistant_masks"].tolist(),
                    }
                    f.write(json.dumps(line) + "\n")


def plain_step(
    steps: int, gpus: int, rows_file: Path, out: Path, dump_first_batch: bool
) -> dict[str, Any]:
    """The same training in a plain script under `torchrun`."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        + [f"--log-dir={out / 'torchrun'}"]  # not a `torchelastic_*` folder left in /tmp
        + [f"--nproc-per-node={gpus}", "-m", "benchmarks.sft_throughput"]
        + ["--plain-rank", str(rows_file), "--plain-out", str(out), "--steps", str(steps)]
        + (["--dump-first-batch"] if dump_first_batch else []),
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the plain script failed:\n{proc.stderr[-4000:]}")
    return json.loads((out / "plain.json").read_text())


def different_settings(steps: int, gpus: int, plain_settings: dict[str, Any]) -> dict[str, Any]:
    """Trainer settings the plain side has other than the pipeline's: {name: (ours, plain)}."""
    from trainflow.strategies import build_strategy
    from trainflow.workloads import sft

    config = pipeline_config(steps, gpus)
    strategy = build_strategy(config.technique)
    model = sft.build_model(sft.SFTJob.model_construct(config=config))
    with tempfile.TemporaryDirectory() as tmp:
        ours = sft._trainer_config(config, strategy, model, Path(tmp)).to_dict()
    keys = (set(ours) | set(plain_settings)) - SAME_SETTINGS_EXCEPT
    ours = json.loads(json.dumps(ours, default=str))
    return {
        k: (ours.get(k), plain_settings.get(k))
        for k in sorted(keys)
        if ours.get(k) != plain_settings.get(k)
    }


def tokens_per_s(side: dict[str, Any]) -> float:
    """Non-padding tokens per second of the Trainer's `train_runtime`."""
    return float(side["tokens"] / side["runtime_s"])


def compare(
    steps: int, gpus: int, out: Path, repeats: int = 1, dump_first_batch: bool = False
) -> dict[str, Any]:
    """Run both sides on the same work, alternately `repeats` times each; the fastest run of
    each side (other work on the machine only ever slows a run down) and the settings that
    differ.

    Raises:
        RuntimeError: a later pipeline run trained on other batches than the first one.
    """
    pipeline_runs: list[dict[str, Any]] = []
    plain_runs: list[dict[str, Any]] = []
    rows: dict[int, dict[str, Any]] = {}
    rows_file = out / "rows.jsonl"
    for _ in range(repeats):
        ours = pipeline_step(steps, gpus)
        if not pipeline_runs:
            rows = train_rows(ours["data_uri"])
            write_plain_rows(rows, ours["batches"], rows_file)
        elif ours["batches"] != pipeline_runs[0]["batches"]:
            raise RuntimeError("the pipeline drew other batches than in its first run")
        pipeline_runs.append(ours)
        plain_runs.append(plain_step(steps, gpus, rows_file, out, dump_first_batch))
    plain = max(plain_runs, key=tokens_per_s)
    ratios = [
        tokens_per_s(a) / tokens_per_s(b) for a, b in zip(pipeline_runs, plain_runs, strict=True)
    ]
    return {
        "pipeline": max(pipeline_runs, key=tokens_per_s),
        "plain": plain,
        "median_ratio": statistics.median(ratios),
        "rows": rows,
        "settings_differ": different_settings(steps, gpus, plain["settings"]),
    }


@contextlib.contextmanager
def busy_core(on: bool) -> Iterator[None]:
    """With `on`, a process spinning on one core for as long as the context lasts."""
    if not on:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per side")
    parser.add_argument("--gpus", type=int, default=2, help="ranks per side")
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs per side, alternating; the fastest counts"
    )
    parser.add_argument(
        "--busy-core",
        action="store_true",
        help="keep one core busy beside both sides (a loaded or slower machine)",
    )
    parser.add_argument("--plain-rank", help=argparse.SUPPRESS)
    parser.add_argument("--plain-out", help=argparse.SUPPRESS)
    parser.add_argument("--dump-first-batch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_rank:
        plain(args.steps, args.plain_rank, args.plain_out, args.dump_first_batch)
        # Exit as the pipeline's ranks do (handlers run, no interpreter teardown): about one
        # run in fifteen, a rank aborted in the teardown of the modules it had loaded
        # ("terminate called without an active exception", no Python frame left), failing
        # a run whose training had finished. Timings come from `train_runtime` either way.
        from trainflow.cli import exit_now

        exit_now()
    with tempfile.TemporaryDirectory() as tmp, busy_core(args.busy_core):
        result = compare(args.steps, args.gpus, Path(tmp), repeats=args.repeats)
    if result["settings_differ"]:
        raise SystemExit(f"the two sides' Trainer settings differ: {result['settings_differ']}")
    ours, base = result["pipeline"], result["plain"]
    if ours["tokens"] != base["tokens"]:
        raise SystemExit(f"the sides trained on {ours['tokens']} and {base['tokens']} tokens")
    ours_tps, base_tps = tokens_per_s(ours), tokens_per_s(base)
    print(
        json.dumps(
            {
                "benchmark": "sft_throughput",
                "ranks": args.gpus,
                "steps": args.steps,
                "repeats": args.repeats,
                "busy_core": args.busy_core,
                "tokens": ours["tokens"],
                "pipeline_tokens_per_s": round(ours_tps, 1),
                "plain_torchrun_tokens_per_s": round(base_tps, 1),
                "pipeline_vs_plain": round(ours_tps / base_tps, 3),
                "pipeline_vs_plain_median": round(result["median_ratio"], 3),
                "data_wait_share": round(ours["data_wait_share"], 4),
                "logging_share": round(ours["logging_s"] / ours["runtime_s"], 4),
            }
        )
    )


if __name__ == "__main__":
    main()
