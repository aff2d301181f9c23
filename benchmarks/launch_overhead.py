"""Launch overhead of `trainflow.distributed` vs a raw `torchrun --standalone`, side by side.

Runs the same 2-rank DDP job both ways, alternating, and prints one JSON line: median wall
times, their ratio, and the time from the call to the end of the first training step.

    python -m benchmarks.launch_overhead [--repeats 3] [--steps 200]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import ddp_job
from trainflow import distributed

REPO = Path(__file__).resolve().parents[1]


def via_trainflow(steps: int) -> tuple[float, float]:
    job = distributed(gpus=2, gpu_type="cpu", timeout=600)(ddp_job.run)
    start = time.time()
    results = job.distributed(steps)
    return time.time() - start, results[0]["first_step_at"] - start


def via_torchrun(steps: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        start = time.time()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--log-dir={Path(tmp) / 'torchrun'}",  # not a folder left in /tmp
                "--nproc-per-node",
                "2",
                str(REPO / "benchmarks" / "ddp_job.py"),
                str(out),
                str(steps),
            ],
            check=True,
            cwd=REPO,
            capture_output=True,
        )
        wall = time.time() - start
        return wall, json.loads(out.read_text())["first_step_at"] - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="Runs of each launcher.")
    parser.add_argument("--steps", type=int, default=200, help="Training steps per run.")
    args = parser.parse_args()
    via_trainflow(5)  # warm file caches for both launchers alike
    rows: dict[str, list[tuple[float, float]]] = {"trainflow": [], "torchrun": []}
    for _ in range(args.repeats):
        rows["torchrun"].append(via_torchrun(args.steps))
        rows["trainflow"].append(via_trainflow(args.steps))
    med = {
        k: (statistics.median(w for w, _ in v), statistics.median(f for _, f in v))
        for k, v in rows.items()
    }
    print(
        json.dumps(
            {
                "benchmark": "launch_overhead",
                "ranks": 2,
                "steps": args.steps,
                "repeats": args.repeats,
                "trainflow_wall_s": round(med["trainflow"][0], 3),
                "torchrun_wall_s": round(med["torchrun"][0], 3),
                "wall_ratio_trainflow_vs_torchrun": round(
                    med["trainflow"][0] / med["torchrun"][0], 3
                ),
                "trainflow_call_to_first_step_s": round(med["trainflow"][1], 3),
                "torchrun_call_to_first_step_s": round(med["torchrun"][1], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
