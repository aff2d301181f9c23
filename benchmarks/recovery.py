"""How fast a run recovers from a lost rank, and how much work it redoes, two ways.

- **launcher restart:** rank 1 of a running 2-rank DDP job (the MLP workload) is SIGKILLed;
  torch elastic restarts the ranks (`max_restarts=1`), which continue from the last checkpoint.
- **--resume:** the whole process group of `python -m flows.mlp` is SIGKILLed (the machine is
  lost), then `python -m flows.mlp --resume RUN_ID` continues it, which includes starting Python,
  Prefect, MLflow and the ranks again.

For each: seconds from the kill to the next completed training step, and the steps trained
again (from the checkpoint to the step reached before the kill). Prints one JSON line.

    python -m benchmarks.recovery [--checkpoint-every 50]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from trainflow import launch
from trainflow.configs.mlp import MLPConfig
from trainflow.strategies.job import Workload, run_on_rank
from trainflow.workloads.mlp import build_model, sample_log_path, train

REPO = Path(__file__).resolve().parents[1]
KILL_ENV = "RECOVERY_KILL_AFTER_STEP"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _restart(records: list[dict]) -> int | None:
    """Index of the first step trained again after a restart (the step count went back)."""
    return next(
        (i for i in range(1, len(records)) if records[i]["step"] <= records[i - 1]["step"]), None
    )


def _measure(records: list[dict], killed_at: float) -> dict:
    i = _restart(records)
    assert i is not None, "no restart in the sample log"
    reached = records[i - 1]["step"]
    return {
        "recovery_s": round(records[i]["time"] - killed_at, 3),
        "steps_recomputed": reached - (records[i]["step"] - 1),
    }


def train_and_die(config: MLPConfig, strategy, **kwargs):
    """The MLP's `train`; in the first attempt rank 1 SIGKILLs itself after the step set in
    RECOVERY_KILL_AFTER_STEP (0 or unset: never) and notes when, in `killed_at` (a real kill:
    no cleanup runs). `tests/distributed/test_recovery.py` trains with it too."""
    kill_after = int(os.environ.get(KILL_ENV, "0"))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if kill_after and first_attempt and os.environ.get("RANK") == "1":
        log = sample_log_path(kwargs["output_dir"], 1)
        stamp = Path(kwargs["output_dir"], "killed_at")

        def kill() -> None:
            while not (log.exists() and len(log.read_text().splitlines()) >= kill_after):
                time.sleep(0.001)
            stamp.write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
    return train(config, strategy, **kwargs)


def launcher_restart(every: int, kill_after: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRAINFLOW_HOME"] = str(Path(tmp) / "home")
        out = Path(tmp) / "out"
        config = MLPConfig(
            num_train_samples=8192,
            num_epochs=4,  # 256 steps of 64 rows per rank
            checkpoint_every=every,
            log_samples=True,
            gpu_type="cpu",
            max_restarts=1,
        )
        workload = Workload(
            train_fn=train_and_die,
            model_fn=build_model,
            config=config,
            output_dir=str(out),
            resume_from=str(out / "checkpoints"),
        )
        options = config.resources.launch_options()
        options = type(options)(**{**options.__dict__, "env": {KILL_ENV: str(kill_after)}})
        launch(run_on_rank, (workload, config.technique), options=options, on_line=lambda *_: None)
        killed_at = float((out / "killed_at").read_text())
        return _measure(_records(sample_log_path(out, 0)), killed_at)


def resume(every: int, kill_after: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "TRAINFLOW_HOME": str(Path(tmp) / "home"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db",
            "PREFECT_HOME": str(Path(tmp) / "prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        env.pop("PREFECT_API_URL", None)
        args = ["--num-epochs", "50", "--checkpoint-every", str(every), "--log-samples"]
        first = subprocess.Popen(
            [sys.executable, "-m", "flows.mlp", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        outputs = Path(tmp) / "home" / "outputs" / "mlp"
        while not list(outputs.glob("*/samples/rank_0.jsonl")):
            time.sleep(0.05)
        run_dir = next(outputs.glob("*/config.json")).parent
        log = sample_log_path(run_dir, 0)
        while len(log.read_text().splitlines()) < kill_after:
            time.sleep(0.001)
        killed_at = time.time()
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        resumed = subprocess.Popen(
            [sys.executable, "-m", "flows.mlp", "--resume", run_dir.name],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            while _restart(_records(log)) is None:
                if resumed.poll() is not None:
                    raise SystemExit(f"the resumed run exited ({resumed.returncode})")
                time.sleep(0.05)
        finally:
            os.killpg(resumed.pid, signal.SIGKILL)
            resumed.wait()
        return _measure(_records(log), killed_at)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint-every", type=int, default=50, help="Checkpoint cadence.")
    parser.add_argument("--kill-after", type=int, default=130, help="Step the kill follows.")
    args = parser.parse_args()
    row = {"benchmark": "recovery", "ranks": 2, "checkpoint_every": args.checkpoint_every}
    for name, measure in (("launcher_restart", launcher_restart), ("resume", resume)):
        for key, value in measure(args.checkpoint_every, args.kill_after).items():
            row[f"{name}_{key}"] = value
    print(json.dumps(row))


if __name__ == "__main__":
    main()
