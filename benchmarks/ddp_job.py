"""A short DDP job, runnable under `torchrun` or `trainflow.distributed` alike.

torchrun --standalone --nproc-per-node 2 benchmarks/ddp_job.py OUT.json STEPS
"""

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainflow import runtime
from trainflow.models.mlp import SimpleMLP


def run(steps: int) -> dict:
    """Train the simple MLP for `steps`; report when the first and last steps ended."""
    with runtime.process_group("gloo"):
        torch.manual_seed(0)
        model = DistributedDataParallel(SimpleMLP())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(64, 10), torch.randn(64, 1)
        first_step_at = 0.0
        for step in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step == 0:
                first_step_at = time.time()
        dist.barrier()
        return {
            "rank": runtime.get_global_rank(),
            "first_step_at": first_step_at,
            "last_step_at": time.time(),
            "loss": loss.item(),
        }


if __name__ == "__main__":
    result = run(int(sys.argv[2]))
    if runtime.is_rank_zero():
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
