"""Each technique expressed to the Lightning and Hugging Face Trainers, on 2 real gloo ranks.

The launcher starts the ranks and opens the process group; the framework must reuse both. Each
test asserts what the framework became (world size, wrapper class, sampler), not the settings
it was given.
"""

import psutil
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainflow import distributed, runtime
from trainflow.strategies import (
    DDPConfig,
    DeepSpeedConfig,
    FSDPConfig,
    OptimizerConfig,
    TechniqueConfig,
    build_strategy,
)
from trainflow.strategies.base import adamw, gather_full_state_dict

MICRO_BATCH = 4
OPTIMIZER = OptimizerConfig(learning_rate=0.01)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x))


class TinyNet(nn.Module):
    """Repeated blocks (what FSDP shards); `labels` gives the loss the HF Trainer reads."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        for block in self.blocks:
            x = block(x)
        out = self.head(x)
        return {"logits": out} | ({} if labels is None else {"loss": F.mse_loss(out, labels)})


def samples(num: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num, 8, generator=gen)
    return x, x.sum(-1, keepdim=True)


def fit_with_lightning(technique: TechniqueConfig) -> dict:
    """Two steps of the Lightning Trainer on this rank; what the Trainer and model became."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self, strategy):
            super().__init__()
            self.net = TinyNet()
            self.technique = strategy

        def configure_model(self) -> None:
            self.technique.prepare_lightning_model(self.net)

        def training_step(self, batch, batch_idx):
            wrapped = self.trainer.strategy.model  # Lightning unwraps it after fit
            self.wrapper = (type(wrapped).__name__, getattr(wrapped, "bucket_bytes_cap", None))
            x, y = batch
            return self.net(x, labels=y)["loss"]

        def configure_optimizers(self):
            return adamw(self.parameters(), OPTIMIZER)

    strategy = build_strategy(technique)
    group = dist.group.WORLD
    trainer = L.Trainer(
        accelerator="gpu" if strategy.device.type == "cuda" else "cpu",
        devices=runtime.get_local_world_size(),
        strategy=strategy.lightning_strategy(
            micro_batch_size=MICRO_BATCH, grad_accum_steps=1, optimizer=OPTIMIZER
        ),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Module(strategy)
    trainer.fit(module, DataLoader(TensorDataset(*samples()), batch_size=MICRO_BATCH))
    module.configure_model()  # as Lightning does again for a later stage (validate, test)
    from torch.distributed.fsdp import FSDPModule

    mesh = getattr(module.net.blocks[0].linear.weight, "device_mesh", None)
    return {
        "world_size": trainer.world_size,
        # Lightning's launcher starts no process when the environment says they exist.
        "children": [c.cmdline() for c in psutil.Process().children(recursive=True)],
        "same_group": dist.group.WORLD is group,
        "steps": trainer.global_step,
        "replicas": trainer.train_dataloader.sampler.num_replicas,
        "wrapper": module.wrapper[0],
        "bucket_bytes": module.wrapper[1],
        "sharded": [isinstance(m, FSDPModule) for m in [module.net, *module.net.blocks]],
        "mesh": (mesh.mesh_dim_names, tuple(mesh.shape)) if mesh is not None else None,
    }


lightning_on_ranks = distributed(gpus=2, gpu_type="cpu", init_process_group=True, timeout=240)(
    fit_with_lightning
)
lightning_on_4_ranks = distributed(gpus=4, gpu_type="cpu", init_process_group=True, timeout=240)(
    fit_with_lightning
)


@pytest.mark.slow
def test_lightning_ddp_reuses_the_ranks_and_wraps_in_ddp():
    results = lightning_on_ranks.distributed(DDPConfig(bucket_cap_mb=2))
    for rank in results:
        assert rank["world_size"] == 2 and rank["children"] == [] and rank["same_group"]
        assert rank["steps"] == 2 and rank["replicas"] == 2
        assert rank["wrapper"] == "DistributedDataParallel"
        assert rank["bucket_bytes"] == 2 * 1024 * 1024


@pytest.mark.slow
def test_lightning_fsdp_shards_every_block_with_fsdp2_over_all_ranks():
    results = lightning_on_ranks.distributed(FSDPConfig(reshard_after_forward=False))
    for rank in results:
        assert rank["world_size"] == 2 and rank["children"] == [] and rank["same_group"]
        # Lightning's default mesh would make both ranks read the same batches (1 replica).
        assert rank["steps"] == 2 and rank["replicas"] == 2
        assert rank["sharded"] == [True, True, True]
        assert rank["mesh"] == (None, (2,))


@pytest.mark.slow
def test_lightning_hsdp_shards_in_groups_and_replicates_across_them():
    results = lightning_on_4_ranks.distributed(FSDPConfig(replicate_degree=2))
    for rank in results:
        assert rank["world_size"] == 4 and rank["children"] == [] and rank["steps"] == 2
        # Data parallel over all 4 ranks; parameters sharded over 2, replicated twice.
        assert rank["replicas"] == 4 and rank["sharded"] == [True, True, True]
        assert rank["mesh"] == (("replicate", "shard"), (2, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lightning_deepspeed_on_gpus():
    gpus = min(2, torch.cuda.device_count())
    on_gpus = distributed(gpus=gpus, init_process_group=True, timeout=600)(fit_with_lightning)
    results = on_gpus.distributed(DeepSpeedConfig(zero_stage=2, mixed_precision="bf16"))
    for rank in results:
        assert rank["world_size"] == gpus and rank["children"] == [] and rank["steps"] == 2
        assert rank["replicas"] == gpus and rank["wrapper"] == "DeepSpeedEngine"


@distributed(gpus=2, gpu_type="cpu", init_process_group=True, timeout=240)
def hf_on_ranks(technique: TechniqueConfig, output_dir: str) -> dict:
    from transformers import Trainer, TrainingArguments

    strategy = build_strategy(technique)
    args = strategy.hf_trainer_args(
        micro_batch_size=MICRO_BATCH,
        grad_accum_steps=2,
        optimizer=OPTIMIZER,
        layer_classes=["Block"],
    )
    x, y = samples()
    trainer = Trainer(
        model=TinyNet(),
        args=TrainingArguments(
            output_dir=output_dir,
            max_steps=2,
            per_device_train_batch_size=MICRO_BATCH,
            gradient_accumulation_steps=2,
            learning_rate=OPTIMIZER.learning_rate,  # DeepSpeed's JSON repeats it; HF compares
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            **args,
        ),
        train_dataset=[{"x": a, "labels": b} for a, b in zip(x, y, strict=True)],
    )
    strategy.prepare_hf_trainer(trainer)
    output = trainer.train()
    from torch.distributed.fsdp import FSDPModule

    state = gather_full_state_dict(trainer.model)
    return {
        "world_size": trainer.args.world_size,
        "steps": output.global_step,
        "wrapper": type(trainer.model_wrapped).__name__,
        "sharded": [isinstance(m, FSDPModule) for m in trainer.model.modules()].count(True),
        "state": {k: tuple(v.shape) for k, v in state.items()},
    }


FULL_STATE = {k: tuple(v.shape) for k, v in TinyNet().state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("technique", "wrapper", "sharded"),
    [
        (DDPConfig(), "DistributedDataParallel", 0),
        (FSDPConfig(), "FSDPTinyNet", 3),  # fully_shard swaps in an FSDPModule subclass
        (DeepSpeedConfig(zero_stage=2), "DeepSpeedEngine", 0),
    ],
    ids=["ddp", "fsdp", "deepspeed"],
)
def test_hf_trainer_applies_each_technique(tmp_path, technique, wrapper, sharded):
    results = hf_on_ranks.distributed(technique, str(tmp_path))
    for rank in results:
        assert rank["world_size"] == 2 and rank["steps"] == 2
        assert rank["wrapper"] == wrapper and rank["sharded"] == sharded
    # The full-state-dict gather that the FSDP save and `TorchStrategy.export` share.
    assert results[0]["state"] == FULL_STATE and results[1]["state"] == {}
