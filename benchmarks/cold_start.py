"""Cold start: how much of `python -m flows.sft` is training, and where the rest goes.

Runs the command as a user would (a new process, the temporary Prefect server, a SQLite MLflow
store in a new folder) three times: `fresh` with new Prefect, MLflow and trainflow homes (a
first run after the install: databases created, data prepared), then `warm` on the same homes
(the data cached, the databases there), then `warm_kept_server` with a server kept running on
that home (`python -m flows.local_server start`, not timed; stopped afterwards). Each output
line is time-stamped as it arrives; the stages are the intervals between the lines the run
prints anyway. Prints one JSON line::

    python benchmarks/cold_start.py [--pipeline sft] [-- ARGS for the pipeline]

`overhead_s` is the wall time minus the training time the run itself reports (`train_runtime`
of the Hugging Face Trainer for SFT: the first to the last step, model and data loaded).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Stage boundaries: the first output line matching each pattern, in the order they happen.
MARKS = {
    "server_started": r"Starting temporary server|Using the kept server",
    "flow_began": r"Beginning flow run",
    "data_ready": r"Task run 'prepare-dataset-\w+' - Finished",
    "mlflow_run": r"MLflow run \w+ (started|continuing)",
    "training_subflow": r"Beginning subflow run",
    "train_ended": r"\[rank 0\] \{'train_runtime'",  # the Trainer's summary (SFT)
    "trained": r"Task run 'train-with-technique-\w+' - Finished",
    "evaluated": r"Task run 'evaluate-\w+' - Finished",
    "registered": r"Task run 'register-model-\w+' - Finished",
    "flow_finished": r"Flow run '[\w-]+' - Finished in state Completed\(\)\s*$",
}
STAGES = [  # name, from mark, to mark
    ("imports_and_checks_s", "start", "server_started"),
    ("server_start_s", "server_started", "flow_began"),
    ("data_s", "flow_began", "data_ready"),
    ("mlflow_run_s", "data_ready", "mlflow_run"),
    ("launch_and_training_s", "training_subflow", "trained"),
    ("evaluate_s", "trained", "evaluated"),
    ("register_s", "evaluated", "registered"),
    ("finish_s", "registered", "exit"),
]


def run_once(pipeline: str, args: list[str], env: dict[str, str], cwd: Path) -> dict:
    """Run the pipeline once; its wall time, training time and stage times in seconds."""
    start = time.monotonic()
    marks: dict[str, float] = {"start": 0.0}
    lines: list[str] = []
    proc = subprocess.Popen(
        [sys.executable, "-m", f"flows.{pipeline}", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.monotonic() - start
        lines.append(line)
        for name, pattern in MARKS.items():
            # The last match for the flow's end (subflows finish first), the first for others.
            if re.search(pattern, line) and (name not in marks or name == "flow_finished"):
                marks[name] = now
    code = proc.wait()
    marks["exit"] = time.monotonic() - start
    if code != 0:
        sys.stderr.write("".join(lines[-40:]))
        raise SystemExit(f"python -m flows.{pipeline} exited with {code}")
    train = re.findall(r"^train_runtime\s*:\s*([\d.]+)", "".join(lines), re.MULTILINE)
    train_s = float(train[-1]) if train else 0.0
    stages = {
        name: round(marks[b] - marks[a], 2) for name, a, b in STAGES if a in marks and b in marks
    }
    if "launch_and_training_s" in stages:
        launch = stages.pop("launch_and_training_s")
        if "train_ended" in marks:
            # What the ranks do after the last step: save the model, and for SFT rank 0
            # evaluates it and logs it to the MLflow run; then they exit.
            after = marks["trained"] - marks["train_ended"]
            stages["after_training_s"] = round(after, 2)
            launch -= after
        stages["launch_s"] = round(launch - train_s, 2)
    return {
        "wall_s": round(marks["exit"], 2),
        "train_s": round(train_s, 2),
        "overhead_s": round(marks["exit"] - train_s, 2),
        "stages": stages,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipeline", default="sft")
    parser.add_argument("args", nargs="*", help="arguments for the pipeline (after --)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cold-start-") as tmp:
        root = Path(tmp)
        env = {
            **os.environ,
            "PREFECT_HOME": str(root / "prefect"),
            "TRAINFLOW_HOME": str(root / "trainflow"),
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        env.pop("PREFECT_API_URL", None)
        env.pop("MLFLOW_TRACKING_URI", None)
        fresh = run_once(opts.pipeline, opts.args, env, root)
        warm = run_once(opts.pipeline, opts.args, env, root)
        server = [sys.executable, "-m", "flows.local_server"]
        subprocess.run([*server, "start"], env=env, cwd=root, check=True, capture_output=True)
        try:
            kept = run_once(opts.pipeline, opts.args, env, root)
        finally:
            subprocess.run([*server, "stop"], env=env, cwd=root, check=True, capture_output=True)
    result = {"fresh": fresh, "warm": warm, "warm_kept_server": kept}
    print(json.dumps({"pipeline": opts.pipeline, "args": opts.args, **result}))


if __name__ == "__main__":
    main()
