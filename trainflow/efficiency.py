"""How efficiently a training run used its ranks: throughput, step time, data waits, memory, MFU.

Every training loop feeds one `EfficiencyMeter` per rank (the shared loop, the Hugging Face
Trainer through a callback, Lightning through a callback and a profiler) and calls `report`
once at the end on every rank. The figures, all named `eff_*`:

- `eff_samples_per_s`, `eff_tokens_per_s`: samples (and non-padding tokens, where the workload
  has tokens) of all ranks per second of the training window.
- `eff_step_time_s`: mean optimizer-step time (the window over the steps).
- `eff_data_wait_share`: the share of the window a rank spent waiting on its data loader (the
  worst rank: a rank that waits holds the others at the next collective).
- `eff_peak_memory_mb`: peak memory of the busiest rank: `torch.cuda.max_memory_allocated` on
  a GPU, the process's peak resident set (RSS) on a CPU.
- On GPUs only: `eff_mfu`, model FLOPs per second over the devices' peak dense bf16 FLOPs
  (`peak_bf16_flops`; absent for a GPU not in the table), and `eff_gpu_hours` of the window.

The training window runs from the first step's start to the last step's end, timed on the host
(on a GPU the host runs at most a step or two ahead of the device: every step's all-reduce and
logged loss wait for it); validation passes are left out of it (`pause`), checkpoints and
logging are in it. Model FLOPs follow the usual
convention: 6 FLOPs per matmul weight per token or sample (forward 2, backward 4), plus
attention's 12 * layers * hidden * sequence per token where the model has attention.
"""

import contextlib
import re
import resource
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

PREFIX = "eff_"
T = TypeVar("T")

# Peak dense (no sparsity) bf16 tensor-core FLOP/s per device, from the vendors' data sheets.
# Keys are the model as it appears, as a whole word, in `torch.cuda.get_device_name()`
# (e.g. "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA A10", "NVIDIA L4").
PEAK_BF16_FLOPS: dict[str, float] = {
    "B200": 2250e12,
    "GH200": 989e12,
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe and NVL boards are below
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "A10G": 70e12,
    "A10": 125e12,
    "L4": 121e12,
}
# Boards of the same model with a lower clock or power limit: (model, word in the name).
_VARIANT_FLOPS: dict[tuple[str, str], float] = {
    ("H100", "PCIE"): 756e12,
    ("H100", "NVL"): 835e12,
}


def peak_bf16_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device named `device_name`, or None when unknown.

    Names are compared word by word, never by substring: "NVIDIA A100-SXM4-80GB" is an A100,
    and "NVIDIA A10" is not.
    """
    words = [w for w in re.split(r"[\s\-_/]+", device_name.upper()) if w]
    for model, flops in PEAK_BF16_FLOPS.items():
        if model in words:
            variant = next(
                (v for (m, w), v in _VARIANT_FLOPS.items() if m == model and w in words), None
            )
            return variant or flops
    return None


def matmul_params(model: nn.Module) -> int:
    """Weights of the model's linear layers: the ones each token or sample multiplies once.

    Embedding lookups cost no FLOPs and are left out; an output layer tied to the embedding is
    an `nn.Linear` and counts.
    """
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def training_flops(
    params: int,
    *,
    num_layers: int | None = None,
    hidden_size: int | None = None,
    seq_len: int | None = None,
) -> float:
    """Model FLOPs of one training step per token (or per sample, for models without tokens).

    `6 * params` (forward and backward through every matmul weight), plus attention's scores and
    weighted sum, `12 * num_layers * hidden_size * seq_len`, when all three are given.
    """
    flops = 6.0 * params
    if num_layers and hidden_size and seq_len:
        flops += 12.0 * num_layers * hidden_size * seq_len
    return flops


def mfu(flops_per_unit: float, units_per_s: float, peak_flops: float, num_devices: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak."""
    return flops_per_unit * units_per_s / (peak_flops * num_devices)


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory in MiB: allocated on its GPU, else its peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, else KiB


class EfficiencyMeter:
    """One rank's step times, data waits and work, reported over all ranks at the end.

    Args:
        device: The rank's device (GPU figures only on CUDA).
        flops_per_token: Model FLOPs of one training token; with `flops_per_sample` None skips
            MFU (used when samples have no tokens).
        flops_per_sample: Model FLOPs of one training sample.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        flops_per_token: float | None = None,
        flops_per_sample: float | None = None,
    ) -> None:
        self.device = device
        self.flops_per_token = flops_per_token
        self.flops_per_sample = flops_per_sample
        self.samples = 0
        self.tokens = 0
        self.steps = 0
        self.waited_s = 0.0
        self.paused_s = 0.0  # pauses between the window's first and last step
        self._paused_since_step = 0.0
        self._started: float | None = None
        self._ended: float | None = None
        self._paused_at: float | None = None

    def start(self) -> None:
        """Open the training window (idempotent: the first call counts)."""
        if self._started is None:
            self._started = time.perf_counter()

    @contextlib.contextmanager
    def data_wait(self) -> Iterator[None]:
        """Time spent in here is waiting on the data loader (opens the window if need be)."""
        self.start()
        began = time.perf_counter()
        try:
            yield
        finally:
            self.waited_s += time.perf_counter() - began

    def timed(self, batches: Iterable[T]) -> Iterator[T]:
        """`batches`, with the time each one takes to arrive counted as a data wait."""
        iterator = iter(batches)
        while True:
            with self.data_wait():
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
            yield batch

    def add_wait(self, seconds: float) -> None:
        """Add a data wait timed elsewhere (e.g. by a framework's profiler)."""
        self.start()
        self.waited_s += seconds

    def count(self, samples: int, tokens: int = 0) -> None:
        """Work of a micro-batch this rank trained on: samples and non-padding tokens."""
        self.samples += samples
        self.tokens += tokens

    def step(self) -> None:
        """An optimizer step ended."""
        self.steps += 1
        self._ended = time.perf_counter()
        self.paused_s += self._paused_since_step
        self._paused_since_step = 0.0

    def pause(self) -> None:
        """Leave what follows out of the window until `resume` (a validation pass)."""
        if self._paused_at is None:
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        """Count time in the window again after `pause`."""
        if self._paused_at is not None:
            self._paused_since_step += time.perf_counter() - self._paused_at
            self._paused_at = None

    def elapsed_s(self) -> float:
        """The training window on this rank so far: first step's start to last step's end."""
        if self._started is None or self._ended is None:
            return 0.0
        return max(self._ended - self._started - self.paused_s, 0.0)

    def report(self) -> dict[str, float]:
        """The `eff_*` figures over all ranks; a collective when a process group is open.

        Every rank must call it, at the same point. Empty when no step was timed.
        """
        local = [
            float(self.samples),
            float(self.tokens),
            self.elapsed_s(),
            self.waited_s,
            float(self.steps),
            peak_memory_mb(self.device),
        ]
        ranks = _gather(local, self.device)
        samples, tokens = sum(r[0] for r in ranks), sum(r[1] for r in ranks)
        elapsed = max(r[2] for r in ranks)
        steps = max(r[4] for r in ranks)
        if elapsed <= 0 or steps <= 0:
            return {}
        figures = {
            "samples_per_s": samples / elapsed,
            "step_time_s": elapsed / steps,
            "data_wait_share": min(max(r[3] / r[2] if r[2] > 0 else 0.0 for r in ranks), 1.0),
            "peak_memory_mb": max(r[5] for r in ranks),
        }
        if tokens > 0:
            figures["tokens_per_s"] = tokens / elapsed
        if self.device.type == "cuda":
            figures |= _gpu_figures(self, figures, elapsed, len(ranks))
        return {f"{PREFIX}{k}": v for k, v in figures.items()}


def _gpu_figures(
    meter: EfficiencyMeter, figures: dict[str, float], elapsed: float, num_devices: int
) -> dict[str, float]:
    out = {"gpu_hours": elapsed * num_devices / 3600.0}
    peak = peak_bf16_flops(torch.cuda.get_device_name(meter.device))
    if peak is None:
        return out
    if meter.flops_per_token is not None and "tokens_per_s" in figures:
        out["mfu"] = mfu(meter.flops_per_token, figures["tokens_per_s"], peak, num_devices)
    elif meter.flops_per_sample is not None:
        out["mfu"] = mfu(meter.flops_per_sample, figures["samples_per_s"], peak, num_devices)
    return out


def _gather(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values` (one all-gather), or just this rank's without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [values]
    # gloo gathers CPU tensors; nccl needs them on the rank's GPU.
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor(values, dtype=torch.float64, device=on)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


def batch_work(batch: Any) -> tuple[int, int]:
    """Samples and non-padding tokens of a language-model batch (a dict with `input_ids` and,
    when padded, `attention_mask`); (len, 0) for a list or a tensor."""
    if isinstance(batch, Mapping) and "input_ids" in batch:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        tokens = int(mask.sum()) if mask is not None else int(ids.numel())
        return int(ids.shape[0]), tokens
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]), 0
    return len(batch), 0
