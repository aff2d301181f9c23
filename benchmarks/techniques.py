"""DDP vs FSDP2 vs ZeRO-1/2/3 on the same transformer: steps/s and peak memory per rank.

Each technique trains the pipeline's default ~10M-parameter model on the same global batches
(warm-up steps untimed) and the script prints one JSON line. On CPU, peak memory is what each
rank's peak resident set grew by from just before `wrap` (DeepSpeed imported first for every
technique, so its import is not counted); on GPUs it is `torch.cuda.max_memory_allocated`.

    python -m benchmarks.techniques [--steps 10] [--warmup 2] [--gpus 2]
"""

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import psutil
import torch

from trainflow import launch, runtime
from trainflow.strategies import DDPConfig, DeepSpeedConfig, FSDPConfig, build_strategy
from trainflow.strategies.loop import Schedule, fit
from trainflow.tracking import NullSink
from trainflow.workloads.transformer import (
    TransformerConfig,
    build_model,
    compute,
    micro_batches,
    wrap_model,
)

TECHNIQUES = {
    "ddp": DDPConfig(),
    "fsdp2": FSDPConfig(),
    "zero1": DeepSpeedConfig(zero_stage=1),
    "zero2": DeepSpeedConfig(zero_stage=2),
    "zero3": DeepSpeedConfig(zero_stage=3),
}


def measure(config: TransformerConfig, name: str, warmup: int, checkpoint_root: str) -> dict:
    """On each rank: wrap, warm up, time the remaining steps, report peak memory."""
    import deepspeed  # noqa: F401 - the same baseline for every technique

    baseline = psutil.Process().memory_info().rss / 2**20
    with runtime.process_group():
        rank, world = runtime.get_global_rank(), runtime.get_world_size()
        t = config.training
        strategy = build_strategy(TECHNIQUES[name])
        wrap_model(config, strategy)

        def run(start: int, end: int) -> float:
            begin = time.perf_counter()
            fit(
                strategy,
                lambda step: micro_batches(config, step, rank, world),
                compute,
                Schedule(end, log_every=end, checkpoint_every=0),
                NullSink(),
                checkpoint_root=Path(checkpoint_root),
                start_step=start,
            )
            return time.perf_counter() - begin

        run(0, warmup)
        elapsed = run(warmup, t.num_steps)
        if strategy.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(strategy.device) / 2**20
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline
        return {"steps_per_s": (t.num_steps - warmup) / elapsed, "peak_mem_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="Timed steps per technique.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed steps first.")
    parser.add_argument("--gpus", type=int, default=2, help="Ranks.")
    parser.add_argument("--gpu-type", default=None, help='"cpu" forces CPU ranks.')
    args = parser.parse_args()
    config = TransformerConfig(
        training={"num_steps": args.warmup + args.steps, "global_batch_size": 16},
        gpus=args.gpus,
        gpu_type=args.gpu_type,
    )
    options = config.resources.launch_options()
    rows = {}
    for name in TECHNIQUES:
        with tempfile.TemporaryDirectory() as tmp:
            job = (config, name, args.warmup, tmp)
            ranks = launch(measure, job, options=options, on_line=lambda *_: None).values
        rows[name] = {
            "steps_per_s": round(min(r["steps_per_s"] for r in ranks), 3),
            "peak_mem_mib_per_rank": [round(r["peak_mem_mib"], 1) for r in ranks],
        }
    params = sum(p.numel() for p in build_model(config).parameters())
    print(
        json.dumps(
            {
                "benchmark": "techniques",
                "ranks": args.gpus,
                "device": "cuda" if torch.cuda.is_available() and args.gpu_type != "cpu" else "cpu",
                "params_m": round(params / 1e6, 2),
                "global_batch_size": config.training.global_batch_size,
                "timed_steps": args.steps,
                **rows,
                "steps_per_s_vs_ddp": {
                    k: round(v["steps_per_s"] / rows["ddp"]["steps_per_s"], 3)
                    for k, v in rows.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
