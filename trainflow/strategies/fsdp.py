"""FSDP2: `fully_shard` each repeated block, then the root; checkpoints with DCP.

Under the Hugging Face Trainer, accelerate's FSDP2 plugin shards (configured through the
environment). Under Lightning, `ModelParallelStrategy` is the FSDP2 strategy (its
`FSDPStrategy` is FSDP1) and it shards nothing itself: the LightningModule's `configure_model`
calls `prepare_lightning_model`, which applies the same sharding as `wrap`.
"""

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed._composable import checkpoint as activation_checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from trainflow import runtime
from trainflow.compat.transformers import shard_with_fsdp2_on_cpu
from trainflow.strategies.base import TorchStrategy, adamw, find_blocks
from trainflow.strategies.config import FSDPConfig, OptimizerConfig
from trainflow.strategies.frameworks import Batches, HFSettings

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy


class FSDPStrategy(TorchStrategy):
    """Per-block sharding with optional HSDP, mixed precision, offload and recomputation."""

    name = "fsdp"
    config: FSDPConfig

    def check_model(self, model: nn.Module) -> None:
        """FSDP needs blocks to shard one at a time; a model without them gains nothing."""
        if not find_blocks(model):
            raise ValueError(
                f"technique fsdp: {type(model).__name__} has no repeated blocks to shard "
                "(an nn.ModuleList of layers of one class); use technique ddp for it"
            )

    def _mesh(self) -> DeviceMesh:
        world = runtime.get_world_size()
        self.config.check_world_size(world)
        replicas = self.config.replicate_degree
        if replicas == 1:
            return init_device_mesh(self.device.type, (world,))
        return init_device_mesh(
            self.device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
        )

    def wrap(
        self,
        model: nn.Module,
        optimizer: OptimizerConfig,
        *,
        micro_batch_size: int,
        grad_accum_steps: int,
    ) -> tuple[nn.Module, Any]:
        self.model = self.shard(model)
        self.optimizer = adamw(self.model.parameters(), optimizer)
        return self.model, self.optimizer

    def shard(self, model: nn.Module) -> nn.Module:
        """Apply FSDP2 to `model` in place: each repeated block, then the root.

        `wrap` calls it, and so does `prepare_lightning_model`. Every rank must call it (it
        builds the device mesh).

        Returns:
            `model`, now an `FSDPModule`, on this rank's device unless parameters are offloaded.
        """
        self.check_model(model)
        bf16 = self.config.mixed_precision == "bf16"
        options: dict[str, Any] = {
            "mesh": self._mesh(),
            "reshard_after_forward": self.config.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=torch.bfloat16 if bf16 else None,
                reduce_dtype=torch.float32 if bf16 else None,
            ),
            "offload_policy": CPUOffloadPolicy() if self.config.cpu_offload else OffloadPolicy(),
        }
        if not self.config.cpu_offload:
            model = model.to(self.device)
        for block in find_blocks(model):
            if self.config.activation_checkpointing:
                activation_checkpoint(block)
            fully_shard(block, **options)
        fully_shard(model, **options)
        return model

    def hf_settings(
        self, batches: Batches, *, layer_classes: list[str], device_type: str
    ) -> HFSettings:
        # transformers 5 hands accelerate the FSDP plugin's settings from `fsdp_config`;
        # transformers 4 passed them through the environment, set too for the frameworks'
        # environments still on it. FSDP version 2 is fully_shard. Checkpoints are sharded
        # (DCP, every rank writes and reads its own part): accelerate's full-state-dict load
        # has only rank 0 join the broadcast under FSDP2. The trained model is exported by
        # gathering its shards (`gather_full_state_dict`), not by `save_model`.
        reshard = self.config.reshard_after_forward
        return HFSettings(
            args={
                "fsdp": "full_shard auto_wrap" + (" offload" if self.config.cpu_offload else ""),
                "fsdp_config": {
                    "version": 2,
                    "transformer_layer_cls_to_wrap": layer_classes,
                    "activation_checkpointing": self.config.activation_checkpointing,
                    "reshard_after_forward": reshard,
                    "state_dict_type": "SHARDED_STATE_DICT",
                },
                "bf16": self.config.mixed_precision == "bf16",
            },
            environ={
                "FSDP_VERSION": "2",
                "FSDP_RESHARD_AFTER_FORWARD": str(reshard).lower(),
                "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
            },
        )

    def prepare_hf_trainer(self, trainer: Any) -> None:
        """Let accelerate shard with FSDP2 on CPU ranks (gloo), as the GPU path does."""
        if self.device.type == "cpu":
            shard_with_fsdp2_on_cpu(trainer)

    def prepare_lightning_model(self, model: nn.Module) -> None:
        """`shard` the model, once: Lightning calls `configure_model` again for each stage."""
        if not isinstance(model, FSDPModule):
            self.shard(model)

    def lightning_settings(self, batches: Batches) -> "ParallelStrategy":
        from lightning.pytorch.strategies import ModelParallelStrategy

        # Data parallel over all ranks: Lightning's default makes the ranks of a node
        # tensor-parallel peers, which all read the same batches. HSDP's 2-D mesh is built in
        # `shard`; to the data loader it is data parallel over all ranks too.
        return ModelParallelStrategy(
            data_parallel_size=runtime.get_world_size(),
            tensor_parallel_size=1,
            process_group_backend=runtime.backend_for(self.device.type),
        )

    @contextlib.contextmanager
    def micro_batch(self, sync: bool) -> Iterator[None]:
        """Keep unsharded gradients local on all but the last micro-batch."""
        model = cast(FSDPModule, self.wrapped)
        model.set_requires_gradient_sync(sync)
        yield
