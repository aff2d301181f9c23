"""The parts of the GPU acceptance run (`benchmarks.gpu_acceptance`), each in a process run by it.

    python -m benchmarks.gpu_acceptance_parts PART [PART...] --out DIR --work DIR [--dry]

Runs the parts in order; each one's output goes to `DIR/PART.log` and its outcome to
`DIR/PART.json`: `status` (ok, failed or skipped), `reason`, `wall_s`, `figures` and `goals` (a
goal's label -> met, or null where it is not judged). The acceptance run watches for each
outcome under the part's own timeout, and stops the process of a part that overruns it; on the
GPU it starts one process per part, so each measures on a device nothing else has used.

Each part imports what it needs inside itself: a machine without a part's packages (DeepSpeed,
Lightning, Prefect) skips that part, naming the package, and runs the others. With `--dry`
each part runs its plumbing at toy size on the CPU (gloo, one rank, fp32, a few steps,
`torch.compile` turned off), which is what the CPU-only CI can run.

On the GPU the technique parts train a Llama with Llama-3.2-1B's dimensions (built from its
config, random weights, `benchmarks.mfu`'s `llama-3.2-1b-shape`) at world size 1 in bf16, with
this package's strategies and train loop, as one rank of a launch would (rank 0 of 1).
"""

import argparse
import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import resource
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainflow.strategies.footprint import Precision

# Our own packages: a module of these that does not import is a defect, never a skip.
OWN_PACKAGES = ("trainflow", "flows", "tasks", "benchmarks", "deployments")
TECHNIQUES = ("ddp", "fsdp2", "zero2", "zero3")
MFU_GOALS = {False: 0.45, True: 0.50}  # eager, compiled: the 1B shape on one H100/H200
MIB = 2**20
_EXCEPTION = re.compile(r"[\w.]*(Error|Exception|Interrupt): ")  # the end of a traceback
_GROUP = contextlib.ExitStack()  # the process group of this process's technique parts


@dataclass(frozen=True)
class Run:
    """Where a part writes, and at which size it runs."""

    out: Path  # logs and outcomes
    work: Path  # models, data, checkpoints: removed after the run unless kept
    dry: bool  # toy size on the CPU


# --- techniques ---------------------------------------------------------------------------


def _technique(name: str, precision: "Precision") -> Any:
    from trainflow.strategies import DDPConfig, DeepSpeedConfig, FSDPConfig

    if name == "ddp":
        return DDPConfig()  # no precision of its own: the loop autocasts, as the Trainer does
    if name == "fsdp2":
        return FSDPConfig(mixed_precision=precision)
    return DeepSpeedConfig(zero_stage=int(name[-1]), mixed_precision=precision)


def _rank_zero_of_one() -> None:
    """The environment a launch gives its only rank (`trainflow.runtime` reads it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _joined_group() -> None:
    """Join a process group as rank 0 of 1, once per process, left at its end: DeepSpeed keeps
    the groups it has seen (a second engine on a new default group fails, "Group ... is not
    registered"), so the techniques that share a process (`--dry`) share its group too."""
    import torch.distributed as dist

    from trainflow import runtime

    if not dist.is_initialized():
        _rank_zero_of_one()
        _GROUP.enter_context(runtime.process_group())


def _memory_mark(device: Any) -> float:
    """Memory in use now, in MiB, with the peak restarted: allocated on a GPU, else the
    resident set (Linux restarts its peak, VmHWM, on request)."""
    import psutil
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / MIB
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return psutil.Process().memory_info().rss / MIB


def _peak_since(mark: float, device: Any) -> float:
    """Peak memory in MiB over `mark` (`_memory_mark`)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / MIB - mark
    with contextlib.suppress(OSError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(s for s in status if s.startswith("VmHWM:")).split()[1]) / 1024 - mark
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - mark


def _what_it_became(name: str, strategy: Any, device: Any) -> dict[str, Any]:
    """The wrapper, optimizer and world the strategy built; raises if they are not the
    technique's (the config echoing back proves nothing)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    wrapped = strategy.wrapped
    optimizer = getattr(wrapped, "basic_optimizer", None) or strategy.optimizer
    became = {
        "wrapped_as": type(wrapped).__name__,
        "optimizer": type(optimizer).__name__,
        "world_size": dist.get_world_size(),
    }
    problems = [] if became["world_size"] == 1 else [f"world size {became['world_size']}"]
    if name == "ddp" and not isinstance(wrapped, DistributedDataParallel):
        problems.append(f"ddp wrapped the model as {became['wrapped_as']}")
    if name == "fsdp2" and not isinstance(wrapped, FSDPModule):
        problems.append(f"fsdp2 wrapped the model as {became['wrapped_as']}, no FSDPModule")
    if name.startswith("zero"):
        stage = wrapped.zero_optimization_stage()
        if stage != int(name[-1]):
            problems.append(f"{name} runs ZeRO stage {stage}")
        if device.type == "cuda" and became["optimizer"] != "FusedAdam":
            problems.append(f"{name} steps with {became['optimizer']}, not the compiled FusedAdam")
    if problems:
        raise RuntimeError("; ".join(problems))
    return became


def technique(name: str, run: Run) -> dict[str, Any]:
    """A few steps of a Llama with technique `name` at world size 1 (bf16 on the GPU), and
    its peak memory against `trainflow.memory.estimate` for the same run."""
    import torch

    from benchmarks.mfu import LLAMA_1B, TINY, build
    from trainflow import runtime
    from trainflow.efficiency import matmul_params, training_flops
    from trainflow.memory import TrainingSetup, estimate, shape_from_config
    from trainflow.strategies import OptimizerConfig, build_strategy
    from trainflow.strategies.loop import Schedule, Work, fit
    from trainflow.tracking import NullSink

    precision: Precision = "fp32" if run.dry else "bf16"
    if run.dry:
        case, num_steps = replace(TINY, batch_size=2, seq_len=32), 2
    else:
        case, num_steps = replace(LLAMA_1B, batch_size=2, seq_len=1024), 4
    config = _technique(name, precision)
    _joined_group()
    device = runtime.get_device()
    mark = _memory_mark(device)
    model = build(case, device).train()
    vocab, shape = model.config.vocab_size, (case.batch_size, case.seq_len)
    sized = shape_from_config(case.name, model.config, "config")  # before ZeRO-3 shards it
    flops = training_flops(
        matmul_params(model),
        num_layers=model.config.num_hidden_layers,
        hidden_size=model.config.hidden_size,
        seq_len=case.seq_len,
    )
    strategy = build_strategy(config)
    strategy.wrap(
        model,
        OptimizerConfig(learning_rate=1e-4),
        micro_batch_size=shape[0],
        grad_accum_steps=1,
    )
    became = _what_it_became(name, strategy, device)
    autocast = device.type == "cuda" and config.precision is None and precision == "bf16"

    def compute(wrapped: Any, tokens: Any) -> dict[str, Any]:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            return {"loss": wrapped(input_ids=tokens, labels=tokens).loss}

    def batches(step: int) -> list[Any]:
        return [torch.randint(vocab, shape, generator=torch.Generator().manual_seed(step))]

    fitted = fit(
        strategy,
        batches,
        compute,
        Schedule(num_steps, log_every=1, checkpoint_every=0),
        NullSink(),
        run.work / "checkpoints" / name,
        work=Work(count=lambda t: (int(t.shape[0]), int(t.numel())), flops_per_token=flops),
    )
    peak = _peak_since(mark, device)
    loss = fitted.history[num_steps]["loss"]
    if not math.isfinite(loss):
        raise RuntimeError(f"{name}: loss {loss} at step {num_steps}")
    setup = TrainingSetup(case.batch_size, case.seq_len, world_size=1, precision=precision)
    predicted = estimate(sized, setup, config)
    # `max_memory_allocated` leaves out what the estimate's reserve stands for (the CUDA
    # context, NCCL, the allocator's cache): compare the rest.
    estimate_mib = (predicted.total - predicted.reserve) / MIB
    eff = fitted.efficiency
    return {
        "model": case.name,
        "params_m": round(sized.params / 1e6, 2),
        "batch": f"{case.batch_size}x{case.seq_len}",
        "precision": precision,
        **became,
        "steps": fitted.steps,
        "loss": round(loss, 4),
        "tokens_per_s": round(eff["eff_tokens_per_s"], 1),
        "step_time_s": round(eff["eff_step_time_s"], 4),
        "mfu": round(eff["eff_mfu"], 4) if "eff_mfu" in eff else None,
        "peak_memory_mib": round(peak, 1),
        "estimate_mib": round(estimate_mib, 1),
        "estimate_error_pct": round(100 * (estimate_mib - peak) / peak, 1),
    }


# --- MFU ----------------------------------------------------------------------------------


def mfu(run: Run, compiled: bool) -> dict[str, Any]:
    """`benchmarks.mfu` on the 1B shape at batch 8 (dry: the tiny Llama on the CPU, with
    `torch.compile` turned off by `TORCH_COMPILE_DISABLE`, so `--compile`'s path runs eager)."""
    import torch

    from benchmarks.mfu import LLAMA_1B, TINY, measure

    if run.dry:
        case, device = replace(TINY, batch_size=2, seq_len=64), torch.device("cpu")
    else:
        case, device = replace(LLAMA_1B, batch_size=8), torch.device("cuda", 0)
    steps, warmup = (2, 1) if run.dry else (8, 2)  # compiled in the first warm-up step
    figures = {"model": case.name, **measure(case, device, steps, warmup, compile=compiled)}
    goal = MFU_GOALS[compiled]
    value = figures["mfu"]
    figures["goals"] = {f"mfu >= {goal}": None if value is None else value >= goal}
    return figures


# --- pipelines ----------------------------------------------------------------------------


def _module(module: str, args: list[str], beside: Callable[[], Any] = lambda: None) -> Any:
    """`python -m MODULE ARGS` to its end, with `beside()` run meanwhile: what `beside`
    returned, and the last line of output that is a JSON object (None without one). Its output
    goes to this part's log; if it fails, the error names its last exception."""
    sys.stdout.flush()
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: dict[str, str] = {}
    copying = threading.Thread(target=_copy, args=(proc.stdout, seen))
    copying.start()
    try:
        found = beside()
    except BaseException:
        proc.terminate()
        raise
    finally:
        proc.wait()
        copying.join()
    if proc.returncode != 0:
        last = seen.get("exception", "see the log")
        raise RuntimeError(f"python -m {module} exited {proc.returncode}: {last}")
    return found, json.loads(seen["json"]) if "json" in seen else None


def _copy(stream: Any, seen: dict[str, str]) -> None:
    """Copy a child's output into this part's log, noting its last exception and JSON line."""
    for line in stream:
        sys.stdout.write(line)
        if _EXCEPTION.match(line):
            seen["exception"] = line.strip()
        elif line.startswith("{"):
            seen["json"] = line
    sys.stdout.flush()


def _last_run(experiment: str) -> Any:
    """The newest MLflow run of `experiment` (the acceptance run's own store)."""
    from trainflow.tracking import store_client

    client = store_client()
    found = client.get_experiment_by_name(experiment)
    runs = (
        client.search_runs([found.experiment_id], order_by=["attributes.start_time DESC"])
        if found
        else []
    )
    if not runs:
        raise RuntimeError(f"no MLflow run in experiment {experiment!r}")
    if runs[0].info.status != "FINISHED":
        raise RuntimeError(f"MLflow run {runs[0].info.run_id} ended {runs[0].info.status}")
    return runs[0]


def _run_figures(run: Any, names: tuple[str, ...]) -> dict[str, Any]:
    metrics, tags = run.data.metrics, run.data.tags
    figures: dict[str, Any] = {"mlflow_run": run.info.run_id, "technique": tags.get("technique")}
    figures |= {name: round(metrics[name], 4) for name in names if name in metrics}
    return figures


def _sft_model(run: Run) -> str:
    """A Llama-3.2-1B-shaped model with random weights, saved as a local model folder with
    the shipped tokenizer (nothing from the Hub); dry: the tiny Llama."""
    if run.dry:
        return "tiny-llama"
    import torch

    from benchmarks.mfu import LLAMA_1B, build
    from trainflow.configs.sft import SHIPPED_TOKENIZER
    from trainflow.data.tokenizer import load_tokenizer

    folder = run.work / "llama-3.2-1b-shape"
    tokenizer = load_tokenizer(SHIPPED_TOKENIZER)
    model = build(LLAMA_1B, torch.device("cuda", 0)).to(torch.bfloat16)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the tokenizer's, for generation
        setattr(model.config, key, getattr(tokenizer, key))
        setattr(model.generation_config, key, getattr(tokenizer, key))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return str(folder)


def sft(run: Run) -> dict[str, Any]:
    """`python -m flows.sft` end to end (prepare, train 50 steps, evaluate, register) on the
    1B-shaped model with DDP in bf16 on one GPU; its peak memory against `plan_memory`."""
    from trainflow.configs.sft import SFTConfig
    from trainflow.memory import GB
    from trainflow.workloads.sft_startup import plan_memory

    config = SFTConfig.model_validate(
        {
            "model": _sft_model(run),
            "dataset": "instructions",
            "max_length": 64 if run.dry else 256,
            "max_steps": 3 if run.dry else 50,
            "precision": "fp32" if run.dry else "bf16",
            "training": {
                "per_device_batch_size": 4 if run.dry else 8,
                "warmup_steps": 0 if run.dry else 5,
                "logging_steps": 1 if run.dry else 10,
                "optimizer": {"learning_rate": 3e-3 if run.dry else 2e-5},
            },
            "evaluation": {"num_samples": 8, "batch_size": 8, "max_new_tokens": 2},
            "technique": {"name": "ddp"},
            "gpus": 1,
            "gpu_type": "cpu" if run.dry else None,
            "retries": 0,
            "checkpoint_every": 0,
            "experiment_name": "acceptance-sft",
            "registered_model_name": "acceptance-sft",
        }
    )
    path = run.work / "sft-config.json"
    path.write_text(config.model_dump_json())
    # The flow's own estimate (it prints it and logs it rounded), made again while it runs.
    plan, _ = _module("flows.sft", ["--config", str(path)], beside=lambda: plan_memory(config))
    figures = _run_figures(
        _last_run("acceptance-sft"),
        ("train_loss", "eval_loss", "eff_tokens_per_s", "eff_mfu", "eff_peak_memory_mb"),
    )
    estimate_mib = (plan.estimate.total - plan.estimate.reserve) / MIB
    figures["estimate_mib"] = round(estimate_mib, 1)
    figures["estimate_gb_with_reserve"] = round(plan.estimate.total / GB, 2)
    peak = figures.get("eff_peak_memory_mb")
    if peak:
        figures["estimate_error_pct"] = round(100 * (estimate_mib - peak) / peak, 1)
    return figures


def two_tower(run: Run) -> dict[str, Any]:
    """The two-tower `gpu` preset (FSDP2 through Lightning) on one GPU for a few steps."""
    _module(
        "flows.two_tower",
        [
            *("--preset", "gpu", "--gpus", "1", "--gpu-type", "cpu" if run.dry else "none"),
            *("--training-max-steps", "3" if run.dry else "20", "--training-num-epochs", "1"),
            *("--checkpoint-every", "0", "--retries", "0", "--evaluation-min-auroc", "0"),
            *("--experiment-name", "acceptance-two-tower"),
            *("--registered-model-name", "acceptance-two-tower"),
        ],
    )
    return _run_figures(
        _last_run("acceptance-two-tower"),
        ("eval_auroc", "eval_recall_at_10", "eff_samples_per_s", "eff_peak_memory_mb"),
    )


def detection(run: Run) -> dict[str, Any]:
    """The detection `gpu` preset (ResNet-50, DDP) on one GPU for a few steps; dry: its
    tiny backbone at 64 px."""
    toy = ["--model-backbone", "tiny", "--data-image-size", "64", "--model-fpn-channels", "64"]
    _module(
        "flows.detection",
        [
            *("--preset", "gpu", "--gpus", "1", "--gpu-type", "cpu" if run.dry else "none"),
            *(toy if run.dry else []),
            *("--training-num-steps", "2" if run.dry else "10"),
            *("--training-global-batch-size", "4" if run.dry else "32"),
            *("--data-num-train-images", "8" if run.dry else "320"),
            *("--data-num-eval-images", "4" if run.dry else "64"),
            *("--checkpoint-every", "0", "--retries", "0", "--evaluation-min-map", "0"),
            *("--experiment-name", "acceptance-detection"),
            *("--registered-model-name", "acceptance-detection"),
        ],
    )
    return _run_figures(
        _last_run("acceptance-detection"),
        ("train_loss", "eval_map", "eff_samples_per_s", "eff_peak_memory_mb"),
    )


# --- checkpoints --------------------------------------------------------------------------


def checkpoint(run: Run) -> dict[str, Any]:
    """`benchmarks.checkpoint` with small arguments: training's stall per checkpoint written
    at once and in the background, read from its last-line JSON."""
    techniques = ("fsdp2",) if run.dry else ("fsdp2", "ddp")
    args = ["--steps", "11", "--every", "5", "--repeats", "1", "--gpus", "1"]
    if run.dry:
        args = ["--steps", "2", "--every", "1", "--repeats", "1", "--gpus", "1"]
        args += ["--gpu-type", "cpu"]
    _, result = _module("benchmarks.checkpoint", [*args, "--techniques", ",".join(techniques)])
    if result is None:
        raise RuntimeError("python -m benchmarks.checkpoint printed no JSON line")
    figures: dict[str, Any] = {"ranks": result["ranks"], "params_m": result["params_m"]}
    for name in techniques:
        for key in ("step_s", "stall_s_sync", "stall_s_async", "blocked_s_async"):
            figures[f"{name}_{key}"] = result[name][key]
    ratio = result["async_over_sync"]
    figures["async_over_sync"] = ratio
    judged = None if run.dry or ratio is None else ratio <= 0.2  # a CPU's stall is not a GPU's
    figures["goals"] = {"async_over_sync <= 0.2": judged}
    return figures


PARTS: dict[str, Callable[[Run], dict[str, Any]]] = {
    "mfu_eager": functools.partial(mfu, compiled=False),
    "mfu_compiled": functools.partial(mfu, compiled=True),
    **{name: functools.partial(technique, name) for name in TECHNIQUES},
    "sft": sft,
    "two_tower": two_tower,
    "detection": detection,
    "checkpoint": checkpoint,
}


def missing_package(exc: ModuleNotFoundError) -> str | None:
    """The package an import failed on, when it is not installed here (else None: a defect)."""
    top = (exc.name or "").split(".")[0]
    if not top or top in OWN_PACKAGES:
        return None
    with contextlib.suppress(ValueError, ImportError):
        if importlib.util.find_spec(top) is not None:
            return None
    return top


def run_part(name: str, run: Run) -> dict[str, Any]:
    """The outcome of part `name`: its figures and goals, or why it failed or was skipped."""
    try:
        figures = PARTS[name](run)
    except ModuleNotFoundError as exc:
        package = missing_package(exc)
        if package is None:
            traceback.print_exc()
            return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
        return {"status": "skipped", "reason": f"needs {package}, not installed here"}
    except Exception as exc:
        traceback.print_exc()
        return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
    goals = figures.pop("goals", {})
    return {"status": "ok", "reason": None, "figures": figures, "goals": goals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="+", choices=sorted(PARTS), help="run in this order")
    parser.add_argument("--out", type=Path, required=True, help="where PART.json and .log go")
    parser.add_argument("--work", type=Path, required=True, help="models, data, checkpoints")
    parser.add_argument("--dry", action="store_true", help="toy size on the CPU")
    args = parser.parse_args()
    if args.dry:  # before torch is imported: it reads both once
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
    args.work.mkdir(parents=True, exist_ok=True)
    with _GROUP:
        for name in args.parts:
            _run_into(name, args)
    os._exit(0)  # the outcomes are written: skip the interpreter's teardown (CUDA, threads)


def _run_into(name: str, args: argparse.Namespace) -> None:
    """Run part `name` with its output in its log, and write its outcome whole."""
    sys.stdout.flush()
    sys.stderr.flush()
    with open(args.out / f"{name}.log", "a") as log:  # this part's output, its children's too
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    begun = time.monotonic()
    outcome = run_part(name, Run(args.out, args.work, args.dry))
    outcome["wall_s"] = round(time.monotonic() - begun, 1)
    print(f"{name}: {outcome['status']} in {outcome['wall_s']} s", flush=True)
    partial = args.out / f".{name}.json.partial"
    partial.write_text(json.dumps(outcome))
    partial.replace(args.out / f"{name}.json")  # whole, for the run watching for it


if __name__ == "__main__":
    main()
