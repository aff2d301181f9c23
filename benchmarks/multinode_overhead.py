"""The Ray path vs the local launcher on the same 2-rank DDP job, side by side.

Starts a Ray cluster of two nodes on this machine (`ray.cluster_utils.Cluster`: a head with no
CPUs and two worker nodes with one CPU each), then runs `benchmarks/ddp_job.py` alternately:

- **ray**: `nnodes=2`, one rank on each Ray node (placement group, one elastic agent per node,
  c10d rendezvous on the first);
- **local**: the same two ranks on one node with the local launcher.

Both sides train the same model on the same data for the same steps with the same seed (the
final losses are checked equal). Prints one JSON line: median launch-to-first-step seconds and
steps/s of each, and their ratios. Every Ray process started here is stopped by its handle.

    python -m benchmarks.multinode_overhead [--repeats 3] [--steps 300]
"""

import argparse
import json
import os
import statistics
import time

from benchmarks import ddp_job
from trainflow import distributed


def one_run(steps: int, ray: bool) -> dict:
    options = {"nnodes": 2} if ray else {}
    job = distributed(gpus=2, gpu_type="cpu", timeout=600, **options)(ddp_job.run)
    start = time.time()
    results = job.distributed(steps)
    wall = time.time() - start
    first, last = results[0]["first_step_at"], results[0]["last_step_at"]
    return {
        "to_first_step_s": first - start,
        "steps_per_s": (steps - 1) / (last - first) if last > first else float("nan"),
        "wall_s": wall,
        "loss": results[0]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="Runs of each side.")
    parser.add_argument("--steps", type=int, default=300, help="Training steps per run.")
    args = parser.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        runs: dict[str, list[dict]] = {"ray": [], "local": []}
        for _ in range(args.repeats):
            for side in ("ray", "local"):
                if side == "ray":
                    os.environ["RAY_ADDRESS"] = cluster.address
                else:
                    os.environ.pop("RAY_ADDRESS", None)
                runs[side].append(one_run(args.steps, side == "ray"))
        losses = {r["loss"] for side in runs.values() for r in side}
        if len(losses) != 1:
            raise SystemExit(f"the two sides did not do the same work: final losses {losses}")

        def median(side: str, key: str) -> float:
            return statistics.median(r[key] for r in runs[side])

        report = {
            "steps": args.steps,
            "repeats": args.repeats,
            "ray_to_first_step_s": round(median("ray", "to_first_step_s"), 2),
            "local_to_first_step_s": round(median("local", "to_first_step_s"), 2),
            "ray_steps_per_s": round(median("ray", "steps_per_s"), 1),
            "local_steps_per_s": round(median("local", "steps_per_s"), 1),
            "ray_wall_s": round(median("ray", "wall_s"), 2),
            "local_wall_s": round(median("local", "wall_s"), 2),
            "cpus": os.cpu_count(),
        }
        report["steps_per_s_ray_over_local"] = round(
            report["ray_steps_per_s"] / report["local_steps_per_s"], 3
        )
        print(json.dumps(report))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
