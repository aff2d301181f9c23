"""A 4-trial MLP sweep under a 2-rank budget vs the same 4 trials run one after another.

Both sides run the same configs (2 CPU ranks each, registration included) in one flow run on
one temporary Prefect server and MLflow store; the sweep overlaps one trial's start-up,
evaluation and registration with another's training, the sequential side does not. Prints one
JSON line: both wall times and their ratio (below 1: the sweep is faster).

    python -m benchmarks.sweep [--steps 60]
"""

import argparse
import atexit
import json
import os
import shutil
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="Training steps per trial.")
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="sweep-bench-")
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    os.environ |= {
        "TRAINFLOW_HOME": home,
        "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    from prefect import flow

    from flows.local_server import local_prefect_server
    from flows.mlp import mlp
    from flows.sweep import SweepConfig, sweep

    rates = [0.01, 0.003, 0.001, 0.03]
    base = {
        "num_train_samples": 1024,
        "num_eval_samples": 64,
        "batch_size": 16,
        "max_steps": args.steps,
        "log_every": 10,
        "checkpoint_every": 0,
        "min_r2": -100.0,
        "registered_model_name": "mlp-bench",
    }
    config = SweepConfig(
        pipeline="mlp",
        space={"learning_rate": rates},
        base=base,
        sampler="grid",
        trials=len(rates),
        budget=2,
        pool="bench-gpus",
        poll_s=0.5,
    )

    @flow(name="sequential-trials")
    def sequential() -> None:
        for rate in rates:
            mlp(config.trial_config({"learning_rate": rate}))

    with local_prefect_server():
        start = time.time()
        sequential()
        sequential_s = time.time() - start
        start = time.time()
        result = sweep(config)
        sweep_s = time.time() - start
    print(
        json.dumps(
            {
                "benchmark": "sweep",
                "trials": len(rates),
                "ranks_per_trial": 2,
                "budget": 2,
                "steps": args.steps,
                "complete": result.num_complete,
                "sequential_s": round(sequential_s, 1),
                "sweep_s": round(sweep_s, 1),
                "sweep_over_sequential": round(sweep_s / sequential_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
