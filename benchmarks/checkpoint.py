"""How long training stalls per checkpoint, written at once (sync) or in the background (async).

The pipeline's default ~10M-parameter transformer trains the same steps on the same batches
three ways in one launch per repeat, side by side: without checkpoints (the baseline), with
checkpoints written at once, and with checkpoints written in the background
(`async_checkpoints`: the state copied to host memory, written by a thread). The stall per
checkpoint is the extra time the steps took over the baseline's, divided by the checkpoints
taken, so it counts what the background thread costs the steps that follow a save too. The
last step's checkpoint (written at once either way) is outside the timed steps.

Techniques: FSDP2 (the transformer's own) and DDP. And `sft`: the SFT pipeline's tiny model
(`debug_cpu`) under DDP through the Hugging Face Trainer (`trainflow.workloads.sft.train`), the
same three ways in one launch, timed from the end of the first step to the end of the last
(before the last step's checkpoint), with the training thread's checkpoint stall alone; its
`blocked_s_*` is not measured.

Also the training thread's own wait inside `save` and publishing (`blocked_s_*`): what a
background save takes off it, apart from what the writing thread costs the cores.

The last line is one JSON object; `async_over_sync` is the worse of the workloads' ratios of
the median stall (lower is better; the goal is 0.2 or less).

    python -m benchmarks.checkpoint [--steps 31] [--every 5] [--repeats 3] [--gpus 2]
        [--techniques fsdp2,ddp,sft]
"""

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from trainflow import launch, runtime
from trainflow.strategies import DDPConfig, FSDPConfig, build_strategy
from trainflow.strategies.loop import Schedule, fit
from trainflow.tracking import NullSink
from trainflow.workloads.transformer import (
    TransformerConfig,
    build_model,
    compute,
    micro_batches,
    wrap_model,
)

TECHNIQUES = {"fsdp2": FSDPConfig(), "ddp": DDPConfig()}
SFT = "sft"  # the SFT pipeline's Trainer, under DDP
MODES = ("none", "sync", "async")


def measure(config: TransformerConfig, technique: str, every: int, root: str) -> dict:
    """On each rank, for each mode in turn: a fresh model, the same steps; seconds from the
    start of the first step to the start of the last (the last step's save is outside)."""
    seconds: dict[str, float] = {}
    blocked: dict[str, list[tuple[float, float]]] = {}
    with runtime.process_group():
        rank, world = runtime.get_global_rank(), runtime.get_world_size()
        t = config.training
        warm = build_strategy(TECHNIQUES[technique])  # first-step costs paid before any mode
        wrap_model(config, warm)
        fit(
            warm,
            lambda step: micro_batches(config, step, rank, world),
            compute,
            Schedule(2, log_every=2, checkpoint_every=0),
            NullSink(),
            checkpoint_root=Path(root) / "warm",
        )
        for mode in MODES:
            strategy = build_strategy(TECHNIQUES[technique])
            wrap_model(config, strategy)
            starts: dict[int, float] = {}
            blocked[mode] = _time_calls(strategy, ("save", "poll_saves", "finish_saves"))

            def batches(step: int, starts: dict[int, float] = starts) -> list:
                starts[step] = time.perf_counter()
                return micro_batches(config, step, rank, world)

            fit(
                strategy,
                batches,
                compute,
                Schedule(
                    t.num_steps,
                    log_every=t.num_steps,
                    checkpoint_every=0 if mode == "none" else every,
                    keep_checkpoints=2,
                    async_checkpoints=mode == "async",
                ),
                NullSink(),
                checkpoint_root=Path(root) / mode,
            )
            seconds[mode] = starts[t.num_steps] - starts[1]
            last = starts[t.num_steps]  # the last step's save is outside the timed steps
            seconds[f"blocked_{mode}"] = sum(d for begin, d in blocked[mode] if begin < last)
    return seconds


def measure_sft(job: Any, strategy: Any, *, output_dir: str, **_: Any) -> dict:
    """On each rank, for each mode in turn: `sft.train` from the same initial weights over the
    same samples; seconds from the end of the first step to the end of the last (the last
    step's save comes after it). Steps end at `runtime.heartbeat`, which the Trainer's
    callback calls after each one."""
    from trainflow.workloads import sft

    ends: dict[int, float] = {}
    beat = runtime.heartbeat

    def heartbeat(step: int, *args: Any, **kwargs: Any) -> None:
        ends[step] = time.perf_counter()
        beat(step, *args, **kwargs)

    runtime.heartbeat = heartbeat  # type: ignore[assignment]
    steps = job.config.max_steps
    warm = {"max_steps": 2, "checkpoint_every": 0}  # first-step costs paid before any mode
    seconds: dict[str, float] = {}
    for mode in ("warm", *MODES):
        update = (
            warm
            if mode == "warm"
            else {
                "checkpoint_every": 0 if mode == "none" else job.config.checkpoint_every,
                "async_checkpoints": mode == "async",
            }
        )
        config = job.config.model_copy(update=update)
        ends.clear()
        sft.train(
            job.model_copy(update={"config": config}),
            build_strategy(config.technique),
            output_dir=str(Path(output_dir) / mode),
        )
        if mode != "warm":
            seconds[mode] = ends[steps] - ends[1]
    return seconds


def sft_rows(args: argparse.Namespace) -> tuple[dict, list[list[dict]]]:
    """The SFT pipeline's debug model: its config and each repeat's ranks' seconds per mode."""
    from trainflow.data import prepare_dataset
    from trainflow.strategies.job import Workload, run_on_rank
    from trainflow.workloads import sft

    preset = sft.load_sft_preset("debug_cpu").model_dump()
    config = sft.SFTConfig.model_validate(
        preset
        | {"max_steps": args.steps, "checkpoint_every": args.every, "keep_checkpoints": 2}
        | {"gpus": args.gpus, "gpu_type": args.gpu_type or preset["gpu_type"]}
    )
    job = sft.SFTJob(config=config, data=prepare_dataset(config.data_config()))
    repeats = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            workload = Workload(
                train_fn="benchmarks.checkpoint:measure_sft",
                model_fn="trainflow.workloads.sft:build_model",
                config=job,
                output_dir=tmp,
                framework="hf",
            )
            options = config.resources.launch_options()
            repeats.append(
                launch(run_on_rank, (workload, config.technique), options=options, on_line=_quiet)
            )
    params = sum(p.numel() for p in sft.build_model(job).parameters())
    return {"sft_params_m": round(params / 1e6, 2)}, [r.values for r in repeats]


def _blocked(waits: dict[str, list[float]]) -> dict[str, float]:
    """The training thread's own wait inside save (and publishing), per checkpoint: what a
    background save takes off it, whatever the writing thread costs the cores."""
    sync, background = statistics.median(waits["sync"]), statistics.median(waits["async"])
    return {
        "blocked_s_sync": round(sync, 4),
        "blocked_s_async": round(background, 4),
        "blocked_async_over_sync": round(background / sync, 3),
    }


def _quiet(*_: object) -> None:
    return None


def _time_calls(strategy: object, names: tuple[str, ...]) -> list[tuple[float, float]]:
    """(start, seconds) of each call to `strategy`'s methods `names`: the training thread
    blocked on checkpoints. The list fills as they run."""
    calls: list[tuple[float, float]] = []
    for name in names:
        method = getattr(strategy, name)

        def timed(*args: object, _method=method, **kwargs: object) -> object:
            begin = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                calls.append((begin, time.perf_counter() - begin))

        setattr(strategy, name, timed)
    return calls


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=31, help="Steps per run (the last untimed).")
    parser.add_argument("--every", type=int, default=5, help="Checkpoint every N steps.")
    parser.add_argument("--repeats", type=int, default=3, help="Launches per technique.")
    parser.add_argument("--gpus", type=int, default=2, help="Ranks.")
    parser.add_argument("--gpu-type", default=None, help='"cpu" forces CPU ranks.')
    parser.add_argument(
        "--techniques", default=",".join([*TECHNIQUES, SFT]), help="Comma-separated."
    )
    args = parser.parse_args()
    names = [n.strip() for n in args.techniques.split(",") if n.strip()]
    unknown = sorted(set(names) - {*TECHNIQUES, SFT})
    if unknown or args.every < 1 or args.steps <= args.every:
        parser.error(
            f"--techniques: unknown {unknown}; known {sorted([*TECHNIQUES, SFT])}"
            if unknown
            else "--every must be at least 1 and below --steps"
        )
    config = TransformerConfig(
        training={"num_steps": args.steps, "global_batch_size": 16},
        gpus=args.gpus,
        gpu_type=args.gpu_type,
    )
    options = config.resources.launch_options()
    saves = (args.steps - 1) // args.every  # checkpoints inside the timed steps
    rows: dict[str, dict] = {}
    extra: dict[str, Any] = {}
    for name in names:
        stalls: dict[str, list[float]] = {"sync": [], "async": []}
        waits: dict[str, list[float]] = {"sync": [], "async": []}
        step_s: list[float] = []
        if name == SFT:
            extra, sft_repeats = sft_rows(args)
        for repeat in range(args.repeats):
            if name == SFT:
                ranks = sft_repeats[repeat]
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    job = (config, name, args.every, tmp)
                    ranks = launch(measure, job, options=options, on_line=_quiet).values
            slowest = {mode: max(r[mode] for r in ranks) for mode in MODES}
            for mode in ("sync", "async"):
                stalls[mode].append((slowest[mode] - slowest["none"]) / saves)
                if name != SFT:
                    waits[mode].append(max(r[f"blocked_{mode}"] for r in ranks) / saves)
            step_s.append(slowest["none"] / (args.steps - 1))
            print(
                f"{name} repeat {repeat + 1}/{args.repeats}: stall per checkpoint "
                f"sync {stalls['sync'][-1]:.3f} s, async {stalls['async'][-1]:.3f} s"
                + (
                    f"; blocked sync {waits['sync'][-1]:.3f} s, async {waits['async'][-1]:.3f} s"
                    if waits["sync"]
                    else ""
                ),
                flush=True,
            )
        sync, background = statistics.median(stalls["sync"]), statistics.median(stalls["async"])
        step = statistics.median(step_s)
        rows[name] = {
            "step_s": round(step, 4),
            "stall_s_sync": round(sync, 4),
            "stall_s_async": round(background, 4),
            "stall_s_sync_all": [round(s, 4) for s in stalls["sync"]],
            "stall_s_async_all": [round(s, 4) for s in stalls["async"]],
            "async_over_sync": round(background / sync, 3) if sync > 0 else None,
            **(_blocked(waits) if waits["sync"] else {}),
            # The share of training time async checkpoints cost at this cadence.
            "async_stall_per_step_time": round(background / (args.every * step), 4),
        }
    params = sum(p.numel() for p in build_model(config).parameters())
    ratios = [r["async_over_sync"] for r in rows.values() if r["async_over_sync"] is not None]
    print(
        json.dumps(
            {
                "benchmark": "checkpoint",
                "machine": f"{cpu_model()}, {psutil.cpu_count(logical=True)} cores",
                "device": "cuda" if torch.cuda.is_available() and args.gpu_type != "cpu" else "cpu",
                "ranks": args.gpus,
                "params_m": round(params / 1e6, 2),
                **extra,
                "steps": args.steps,
                "checkpoint_every": args.every,
                "checkpoints_timed": saves,
                **rows,
                "async_over_sync": max(ratios) if ratios else None,
            }
        )
    )


if __name__ == "__main__":
    main()
