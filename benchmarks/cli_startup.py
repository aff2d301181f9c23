"""Start-up of the pipelines' command lines vs `import prefect`, side by side.

Times fresh `python -c "import prefect"`, `python -m flows.sft --help` and
`python -m flows.mlp --help` processes, interleaved, and prints one JSON line: the median wall
time of each, each `--help`'s ratio to `import prefect` (the floor any flow module pays; the
target is at most `target_ratio`), and the heavy packages each `--help` imported (read from one
`python -X importtime` run), which name what to make lazy when a ratio is off target.

    python -m benchmarks.cli_startup [--runs 5]
    python benchmarks/cli_startup.py [--runs 5]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TARGET_RATIO = 1.5
BASELINE = "import_prefect"
COMMANDS = {
    BASELINE: ["-c", "import prefect"],
    "sft_help": ["-m", "flows.sft", "--help"],
    "mlp_help": ["-m", "flows.mlp", "--help"],
}
HEAVY = (
    "torch",
    "transformers",
    "trl",
    "datasets",
    "streaming",
    "mlflow",
    "deepspeed",
    "lightning",
)


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )


def wall_time(args: list[str]) -> float:
    """Seconds from spawning `python args` to its exit."""
    start = time.perf_counter()
    _run(args)
    return time.perf_counter() - start


def heavy_imports(args: list[str]) -> list[str]:
    """The `HEAVY` packages `python args` imports, from `-X importtime`'s report on stderr."""
    report = _run(["-X", "importtime", *args]).stderr
    imported = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in report.splitlines()
        if line.startswith("import time:")
    }
    return sorted(imported.intersection(HEAVY))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="Timed runs of each command.")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    for command in COMMANDS.values():  # warm file caches for every command alike
        _run(command)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.runs):
        for name, command in COMMANDS.items():
            times[name].append(wall_time(command))
    median = {name: statistics.median(t) for name, t in times.items()}
    row: dict[str, object] = {"benchmark": "cli_startup"}
    row.update({f"{name}_s": round(s, 3) for name, s in median.items()})
    helps = [name for name in COMMANDS if name != BASELINE]
    for name in helps:
        row[f"{name}_ratio"] = round(median[name] / median[BASELINE], 3)
    row["target_ratio"] = TARGET_RATIO
    row["runs"] = args.runs
    for name in helps:
        row[f"{name}_heavy"] = heavy_imports(COMMANDS[name])
    print(json.dumps(row))


if __name__ == "__main__":
    main()
