"""One acceptance run on one GPU: the techniques, the pipelines, MFU, the memory estimate and the
checkpoint stall, in 6 minutes on one H100 or H200.

    bash scripts/gpu-check.sh                  # this, writing the results into docs/gpu.md
    python -m benchmarks.gpu_acceptance [--out DIR] [--write-docs docs/gpu.md] [--parts a,b]
    python -m benchmarks.gpu_acceptance --dry  # every part's plumbing at toy size on the CPU

Each part (`PARTS`; what it runs is in `benchmarks.gpu_acceptance_parts`, how it is run in
`benchmarks.gpu_acceptance_runner`) runs in a process of its own under a timeout of its own,
and ends ok, failed or skipped (a package it needs is missing, named in the reason); a part
that fails or hangs leaves the others to run, and the whole run stays within `--budget-s`. The
run prints one line per part as it ends, then a markdown table (status, wall time, figures,
goals), then one JSON object on the last line, and writes both to `--out` with each part's log.
`--write-docs FILE` puts the table, the date, the device and the versions it ran with between
the markers of FILE's results section. The exit status is 1 if any part failed (a missed goal
is reported, not a failure), 2 for a usage error or no CUDA device without `--dry`.

With `--dry` each part runs at toy size on the CPU (gloo, one rank, fp32, 2-3 steps, no
compile), the parts that share their imports (`Part.group`) in one process, two processes at a
time: what the CPU-only CI runs.

The run needs only what is installed on the machine (no package index): this module imports
the standard library only, and each part imports what it needs in its own process. Models,
data, MLflow and Prefect state live under `--out`/work, removed at the end (`--keep-work`).
"""

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_acceptance_runner import Acceptance, Part
from trainflow.launch.plan import query_gpus

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "gpu.md"
START, END = "<!-- gpu-acceptance results: start -->", "<!-- gpu-acceptance results: end -->"
BUDGET_S = 360.0  # one H100 or H200
DRY_BUDGET_S = 240.0  # a bound for a slow CI machine; a dry run takes about a minute or two
MEMORY_GOAL_PCT = 15.0
# label: distributions, the first installed wins
PACKAGES = {
    "torch": ("torch",),
    "torchvision": ("torchvision",),
    "transformers": ("transformers",),
    "accelerate": ("accelerate",),
    "trl": ("trl",),
    "peft": ("peft",),
    "datasets": ("datasets",),
    "deepspeed": ("deepspeed",),
    "lightning": ("lightning",),
    "torchmetrics": ("torchmetrics",),
    "streaming": ("streaming-community", "mosaicml-streaming"),
    "prefect": ("prefect",),
    "mlflow": ("mlflow",),
}
_PROBE = """import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version(), "cuda_available": cuda,
    "gpus": torch.cuda.device_count() if cuda else 0}))
"""


_FLOW = ("prefect", "mlflow", "streaming", "matplotlib")
_LLAMA = ("torch", "transformers")
_PIPELINE = ("mlflow", "prefect")  # what a pipeline's part waits for
_MEASURED = ("ddp", "fsdp2", "zero2", "zero3", "sft")  # their peak memory against the estimate
_TECHNIQUES = {
    "ddp": ("DDP, bf16 autocast", ()),
    "fsdp2": ("FSDP2 (fully_shard), bf16 mixed precision", ()),
    "zero2": ("DeepSpeed ZeRO-2, bf16, its compiled FusedAdam", ("deepspeed",)),
    "zero3": ("DeepSpeed ZeRO-3, bf16, its compiled FusedAdam", ("deepspeed",)),
}


def memory_check(outcomes: dict[str, dict[str, Any]], dry: bool) -> dict[str, Any]:
    """The estimate's error per technique and for the SFT run, from their parts' figures;
    judged on a GPU only (a CPU's peak resident set is not what the estimate counts)."""
    figures, goals = {}, {}
    for name in _MEASURED:
        error = outcomes.get(name, {}).get("figures", {}).get("estimate_error_pct")
        if error is not None:
            figures[name] = error
            judged = None if dry else abs(error) <= MEMORY_GOAL_PCT
            goals[f"{name} within {MEMORY_GOAL_PCT:g} %"] = judged
    if not figures:
        ran = [outcomes[n]["status"] for n in _MEASURED if n in outcomes]
        status = "failed" if "failed" in ran else "skipped"
        return {"status": status, "reason": "no technique measured its peak", "wall_s": 0.0}
    return {"status": "ok", "reason": None, "wall_s": 0.0, "figures": figures, "goals": goals}


PARTS = (
    Part(
        "mfu_eager",
        "benchmarks.mfu: the 1B shape at batch 8x2048, bf16 autocast, eager",
        needs=_LLAMA,
        timeout_s=60,
        dry_timeout_s=90,
        shown=("mfu", "tokens_per_s", "peak_memory_mb"),
        goal="MFU >= 0.45",
        group="llama",
    ),
    Part(
        "mfu_compiled",
        "the same through torch.compile (compiled in the untimed warm-up)",
        needs=_LLAMA,
        timeout_s=150,
        dry_timeout_s=60,
        shown=("mfu", "tokens_per_s", "peak_memory_mb"),
        goal="MFU >= 0.50",
        group="llama",
    ),
    *(
        Part(
            name,
            f"{text}, world size 1: 4 steps of the 1B shape at 2x1024 tokens",
            needs=(*_LLAMA, *extra),
            timeout_s=60,
            dry_timeout_s=60,
            shown=("tokens_per_s", "peak_memory_mib", "estimate_mib", "estimate_error_pct"),
            group="llama",
            waits_for=("fused_adam",) if extra else (),
        )
        for name, (text, extra) in _TECHNIQUES.items()
    ),
    Part(
        "checkpoint",
        "benchmarks.checkpoint: FSDP2 and DDP on 1 rank, the stall per checkpoint written at "
        "once and in the background",
        needs=("torch", "psutil"),
        timeout_s=60,
        dry_timeout_s=120,
        shown=("fsdp2_stall_s_sync", "fsdp2_stall_s_async", "async_over_sync"),
        goal="async_over_sync <= 0.2",
    ),
    Part(
        "sft",
        "python -m flows.sft end to end on the 1B shape (random weights, no Hub), DDP, bf16, "
        "50 steps",
        needs=(*_LLAMA, "trl", "peft", "accelerate", "datasets", *_FLOW),
        timeout_s=150,
        dry_timeout_s=120,
        shown=("train_loss", "eval_loss", "eff_tokens_per_s", "eff_peak_memory_mb"),
        waits_for=_PIPELINE,
    ),
    Part(
        "memory",
        "trainflow.memory's estimate, less its reserve, against the measured peak "
        "(max_memory_allocated) of ddp, fsdp2, zero2, zero3 and sft",
        needs=(),
        timeout_s=0,
        dry_timeout_s=0,
        shown=_MEASURED,
        goal=f"|error| <= {MEMORY_GOAL_PCT:g} % each",
        derive=memory_check,
    ),
    Part(
        "two_tower",
        "python -m flows.two_tower --preset gpu (FSDP2 through Lightning) on 1 GPU, 20 steps",
        needs=("torch", "lightning", "torchmetrics", "pandas", *_FLOW),
        timeout_s=60,
        dry_timeout_s=120,
        shown=("eval_auroc", "eff_samples_per_s", "eff_peak_memory_mb"),
        waits_for=_PIPELINE,
    ),
    Part(
        "detection",
        "python -m flows.detection --preset gpu (ResNet-50, DDP) on 1 GPU, 10 steps",
        needs=("torch", "torchvision", "torchmetrics", "pycocotools", *_FLOW),
        timeout_s=75,
        dry_timeout_s=120,
        shown=("train_loss", "eval_map", "eff_samples_per_s"),
        waits_for=_PIPELINE,
    ),
)


def part(name: str) -> Part:
    return next(p for p in PARTS if p.name == name)


def versions() -> dict[str, str]:
    """The installed version of each package the parts use ("-" when missing)."""
    found = {"python": platform.python_version()}
    for label, distributions in PACKAGES.items():
        found[label] = "-"
        for dist in distributions:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                found[label] = importlib.metadata.version(dist)
                break
    return found


def isolated_env(work: Path, dry: bool) -> dict[str, str]:
    """What every process of the run reads: its own homes under `work`, this checkout on the
    path, no Hub, and with `--dry` no GPU."""
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "TRAINFLOW_HOME": str(work / "home"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}",
        "PREFECT_HOME": str(work / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def probe() -> dict[str, Any]:
    """torch's version and what it sees of CUDA, asked in a process of its own: this one never
    touches CUDA (a context here would hold GPU memory for the whole run)."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120
        )
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return {"cuda_available": False, "torch": "does not import here"}


def describe_device(found: dict[str, Any], dry: bool) -> str:
    if dry or not found.get("cuda_available"):
        return f"cpu ({os.cpu_count()} cores)"
    rows = query_gpus("name", "memory.total", "driver_version") or []
    if not rows:
        return f"{found['gpus']} CUDA GPU(s)"
    name, mib, driver = rows[0]
    return f"{name}, {float(mib) / 1024:.0f} GiB, driver {driver} (x{len(rows)})"


def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def goal_cell(p: Part, outcome: dict[str, Any]) -> str:
    goals = outcome.get("goals") or {}
    if not goals:
        return _cell(p.goal)
    said = {True: "met", False: "missed", None: "not judged here"}
    return _cell("; ".join(f"{label}: {said[met]}" for label, met in goals.items()))


def table(parts: list[Part], outcomes: dict[str, dict[str, Any]]) -> str:
    """The markdown table: one row per part, in the run's order."""
    rows = ["| Part | Status | Wall s | Figures | Goal |", "|---|---|---:|---|---|"]
    for p in parts:
        outcome = outcomes[p.name]
        status = outcome["status"] + (f": {outcome['reason']}" if outcome.get("reason") else "")
        figures = outcome.get("figures") or {}
        shown = ", ".join(f"{k} {_number(figures[k])}" for k in p.shown if k in figures)
        row = [
            p.name,
            _cell(status),
            f"{outcome['wall_s']:.1f}",
            _cell(shown),
            goal_cell(p, outcome),
        ]
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows)


def summary(acceptance: Acceptance, device: str, found_versions: dict[str, Any]) -> dict[str, Any]:
    """The run as one JSON object (the last line printed)."""
    parts = {p.name: acceptance.outcomes[p.name] for p in acceptance.parts}
    failed = [name for name, o in parts.items() if o["status"] == "failed"]
    missed = [
        f"{name}: {label}"
        for name, o in parts.items()
        for label, met in (o.get("goals") or {}).items()
        if met is False
    ]
    return {
        "benchmark": "gpu_acceptance",
        "dry": acceptance.dry,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device,
        "versions": found_versions,
        "budget_s": acceptance.budget_s,
        "wall_s": round(time.monotonic() - acceptance.started, 1),
        "prepared": acceptance.prepared,
        "parts": parts,
        "failed": failed,
        "goals_missed": missed,
        "ok": not failed,
    }


def results_section(result: dict[str, Any], text: str) -> str:
    """What `--write-docs` puts between the markers: when, where, with what, and the table."""
    kind = "Newest run"
    if result["dry"]:
        kind = "Dry run (toy sizes on the CPU: plumbing only, no GPU figures)"
    verdict = (
        "every part ok or skipped" if result["ok"] else f"failed: {', '.join(result['failed'])}"
    )
    shown = ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v not in (None, "-"))
    missed = (
        f" Goals missed: {'; '.join(result['goals_missed'])}." if result["goals_missed"] else ""
    )
    return (
        f"{kind}: {result['date']} on {result['device']}, {result['wall_s']:.0f} s "
        f"(budget {result['budget_s']:.0f} s); {verdict}.{missed}\n\n"
        f"Versions: {shown}.\n\n{text}\n"
    )


def check_docs(path: Path, dry: bool) -> str | None:
    """Why results cannot go into `path`, or None."""
    if dry and path.resolve() == DOCS:
        return f"--dry does not write {DOCS.relative_to(REPO)}: its results are GPU runs only"
    if not path.is_file():
        return f"--write-docs {path}: no such file"
    text = path.read_text()
    if START not in text or END not in text or text.index(START) > text.index(END):
        return f"--write-docs {path}: the file has no results section ({START} ... {END})"
    return None


def write_docs(path: Path, section: str) -> None:
    text = path.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{START}\n{section}{END}{tail}")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    listed = "\n".join(
        f"  {p.name:13} {p.checks}" + (f" ({p.goal})" if p.goal else "") for p in PARTS
    )
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_acceptance",
        description=__doc__,
        epilog=f"parts, in the order they run:\n{listed}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dry", action="store_true", help="toy sizes on the CPU (the CI's run)")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "test-output" / "gpu-check",
        help="logs and results (default test-output/gpu-check)",
    )
    parser.add_argument("--write-docs", type=Path, help="put the results into this file's section")
    parser.add_argument("--parts", help="comma-separated (default: all; listed below)")
    parser.add_argument(
        "--budget-s",
        type=float,
        help=f"the whole run's bound in s (default {BUDGET_S:.0f}, --dry {DRY_BUDGET_S:.0f})",
    )
    parser.add_argument("--jobs", type=int, help="parts' processes at a time (default 1, --dry 2)")
    parser.add_argument("--keep-work", action="store_true", help="keep models, data and stores")
    args = parser.parse_args(argv)
    known = [p.name for p in PARTS]
    names = [n.strip() for n in (args.parts or ",".join(known)).split(",") if n.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    args.selected = [p for p in PARTS if p.name in names]
    args.budget_s = args.budget_s or (DRY_BUDGET_S if args.dry else BUDGET_S)
    args.jobs = args.jobs or (2 if args.dry else 1)
    if args.budget_s <= 0 or args.jobs < 1:
        parser.error("--budget-s must be above 0 and --jobs at least 1")
    args.out = args.out.resolve()
    problem = check_docs(args.write_docs, args.dry) if args.write_docs else None
    if problem:
        parser.error(problem)
    return args


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # as Ctrl-C does: the parts' processes are stopped


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    signal.signal(signal.SIGTERM, _terminate)
    work = args.out / "work"
    os.environ.update(isolated_env(work, args.dry))  # before Prefect is imported: it reads them
    found = probe()
    if not args.dry and not found.get("cuda_available"):
        print(
            "benchmarks.gpu_acceptance: torch sees no CUDA device here; --dry runs every part's "
            "plumbing at toy size on the CPU",
            file=sys.stderr,
        )
        return 2
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    work.mkdir(exist_ok=True)
    device = describe_device(found, args.dry)
    found_versions = {**versions(), **{k: found.get(k) for k in ("torch", "cuda", "cudnn")}}
    print(f"gpu acceptance{' (dry)' if args.dry else ''} on {device}", flush=True)
    print(", ".join(f"{k} {v}" for k, v in found_versions.items()), flush=True)
    acceptance = Acceptance(
        args.selected, args.out, dry=args.dry, jobs=args.jobs, budget_s=args.budget_s
    )
    try:
        with contextlib.ExitStack() as stack:
            acceptance.run(stack)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    result = summary(acceptance, device, found_versions)
    text = table(acceptance.parts, acceptance.outcomes)
    (args.out / "results.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.write_docs:
        write_docs(args.write_docs, results_section(result, text))
    print(text)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
