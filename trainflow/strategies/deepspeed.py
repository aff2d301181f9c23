"""DeepSpeed ZeRO 1/2/3: the engine owns backward, step and checkpoints.

On CPU DeepSpeed picks its CPU accelerator and uses the gloo group already initialised;
`deepspeed_json` selects torch's AdamW there, as DeepSpeed's fused and CPU Adam need compiled
ops. DeepSpeed is imported on the rank only, when `wrap` (or `hf_trainer_args`) runs.

The same JSON drives the Hugging Face Trainer (`deepspeed=`) and Lightning's
`DeepSpeedStrategy(config=...)`; Lightning runs DeepSpeed on CUDA GPUs only.
"""

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from trainflow import runtime
from trainflow.compat import safe_load
from trainflow.compat.deepspeed import no_compiled_ops
from trainflow.strategies.base import Strategy
from trainflow.strategies.config import DeepSpeedConfig, OptimizerConfig, deepspeed_json
from trainflow.strategies.frameworks import Batches, HFSettings

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy


_ARCH = re.compile(r"(\d+)\.(\d+)[a-z]*(\+PTX)?")


def readable_arch_list(value: str) -> str:
    """`TORCH_CUDA_ARCH_LIST` as DeepSpeed's op builder can read it: `major.minor[+PTX]`.

    torch accepts architecture-specific targets such as `9.0a` (Hopper's wgmma) or `10.0f`,
    and CUDA images set them; DeepSpeed's JIT builder parses every entry as integers and fails
    on them (`invalid literal for int() with base 10: '0a'`) when it builds an op (fused
    Adam). Each such entry becomes its plain target (`9.0a` -> `9.0`), which DeepSpeed's
    kernels need no more than; duplicates go, the order stays. Entries it cannot read at all
    are left for DeepSpeed to name.
    """
    entries: list[str] = []
    for entry in value.replace(" ", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        match = _ARCH.fullmatch(entry)
        if match is not None:
            entry = f"{match[1]}.{match[2]}{match[3] or ''}"
        if entry not in entries:
            entries.append(entry)
    return ";".join(entries)


def prepare_compiled_ops(device_type: str) -> None:
    """Set DeepSpeed up for its compiled ops before it starts, on this rank.

    - Off CUDA, tell it that no compiled op is available: none is needed there (torch's AdamW,
      gloo), and saying so stops each rank probing compilers for every op (~10 s) and
      JIT-building a shared-memory all-reduce (minutes on a cold cache).
    - On CUDA, rewrite a `TORCH_CUDA_ARCH_LIST` its op builder cannot read
      (`readable_arch_list`), so that fused Adam builds on images that list `9.0a`.

    Every caller is about to run DeepSpeed (our loop, the Trainer, Lightning), so its
    checkpoint loads are made to refuse pickled code here too (`safe_load`).
    """
    safe_load.install_deepspeed()
    if device_type != "cuda":
        no_compiled_ops()
        return
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if value and (readable := readable_arch_list(value)) != value:
        logging.getLogger(__name__).info(
            "TORCH_CUDA_ARCH_LIST %r -> %r for DeepSpeed's op builder", value, readable
        )
        os.environ["TORCH_CUDA_ARCH_LIST"] = readable


class DeepSpeedStrategy(Strategy):
    """`deepspeed.initialize` with a JSON config built from `DeepSpeedConfig`."""

    name = "deepspeed"
    config: DeepSpeedConfig

    def wrap(
        self,
        model: nn.Module,
        optimizer: OptimizerConfig,
        *,
        micro_batch_size: int,
        grad_accum_steps: int,
    ) -> tuple[nn.Module, Any]:
        import deepspeed
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
        prepare_compiled_ops(self.device.type)
        batches = Batches(micro_batch_size, grad_accum_steps, optimizer)
        ds_config = self._json(batches, self.device.type)
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config
        )
        self.model, self.optimizer = engine, ds_optimizer
        return engine, ds_optimizer

    def _json(self, batches: Batches, device_type: str) -> dict[str, Any]:
        return deepspeed_json(
            self.config,
            micro_batch_size=batches.micro_batch_size,
            grad_accum_steps=batches.grad_accum_steps,
            world_size=runtime.get_world_size(),
            optimizer=batches.optimizer,
            device_type=device_type,
        )

    def hf_settings(
        self, batches: Batches, *, layer_classes: list[str], device_type: str
    ) -> HFSettings:
        prepare_compiled_ops(device_type)
        return HFSettings(
            {
                "deepspeed": self._json(batches, device_type),
                "bf16": self.config.mixed_precision == "bf16",
            }
        )

    def lightning_settings(self, batches: Batches) -> "ParallelStrategy":
        from lightning.pytorch.plugins.precision import DeepSpeedPrecision
        from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy

        prepare_compiled_ops(self.device.type)
        config = self._json(batches, self.device.type)
        # Lightning sets this from Trainer(accumulate_grad_batches=...) and refuses it in the
        # JSON; DeepSpeed still checks train_batch_size, so a Trainer that disagrees fails.
        del config["gradient_accumulation_steps"]
        # Lightning casts float inputs to the precision its plugin names; take it from the JSON
        # (a user's config_file may enable bf16 or fp16 itself).
        if config.get("bf16", {}).get("enabled") is True:
            precision = DeepSpeedPrecision("bf16-mixed")
        elif config.get("fp16", {}).get("enabled") is True:
            precision = DeepSpeedPrecision("16-mixed")
        else:
            precision = DeepSpeedPrecision("32-true")
        return LightningDeepSpeedStrategy(
            config=config,
            process_group_backend=runtime.backend_for(self.device.type),
            precision_plugin=precision,
        )

    @property
    def engine(self) -> Any:
        """The DeepSpeed engine `wrap` returned."""
        return self.wrapped

    def backward(self, loss: Any) -> None:
        """The engine's backward: ZeRO reduces and partitions gradients in its hooks."""
        self.engine.backward(loss, scale_wrt_gas=False)

    @contextlib.contextmanager
    def micro_batch(self, sync: bool) -> Iterator[None]:
        """DeepSpeed counts micro-batches itself: a non-final one ends with a counting step."""
        yield
        if not sync:
            self.engine.step()

    def step(self) -> None:
        """The engine's step at the accumulation boundary (it also clears the gradients)."""
        self.engine.step()

    def _save(self, path: Path) -> None:
        self.engine.save_checkpoint(str(path.parent), tag=path.name, save_latest=False)

    def _load(self, path: Path) -> None:
        load_path, _ = self.engine.load_checkpoint(str(path.parent), tag=path.name)
        if load_path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint in {path}")

    def export(self, path: Path) -> None:
        """Gather the weights (ZeRO-3 partitions included) into one file written by rank 0."""
        self.engine.save_16bit_model(str(path.parent), path.name)
        dist.barrier()
