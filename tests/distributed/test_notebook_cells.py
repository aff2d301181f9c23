"""Notebook cells written for GPUs run unchanged under `.distributed()` on 2 CPU ranks.

Each cell is what a user of a managed notebook writes for 8 H100s (`gpu_type="H100"`,
`init_process_group("nccl")`, `bf16=True`, `Trainer(devices="auto")`, a plain ZeRO-3 JSON), with
only the import changed. Here no GPU exists, so they run with TRAINFLOW_CPU_FALLBACK=1. Each
test asserts what the framework became inside the ranks (world size 2), that the two ranks
trained on different samples, and that the loss went down.
"""

import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT
from trainflow import (
    RankError,
    RemoteNotConfiguredError,
    distributed,
)

TOKENIZER = str(REPO_ROOT / "data" / "tokenizer")
ROWS = [{"text": f"question {i}: what is {i} plus {i}? answer: {2 * i}"} for i in range(64)]

DEEPSPEED_ZERO3 = {  # the plain config a DeepSpeed user writes for GPUs
    "zero_optimization": {"stage": 3},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
}


@pytest.fixture
def cpu_fallback(monkeypatch):
    monkeypatch.setenv("TRAINFLOW_CPU_FALLBACK", "1")


@distributed(gpus=2, gpu_type="H100")
def sft_cell(output_dir: str, technique: str) -> dict:
    """TRL's SFTTrainer as the catalogue's cells use it, bf16 on."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from trainflow.models.causal_lm import model_config

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config("tiny-llama", tokenizer))
    technique_args = {
        "ddp": {},
        "fsdp": {
            "fsdp": "full_shard auto_wrap",
            "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        },
        "zero3": {"deepspeed": DEEPSPEED_ZERO3},
    }[technique]
    args = SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        max_steps=8,
        learning_rate=1e-3,
        bf16=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        **technique_args,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    seen: list[tuple[int, ...]] = []
    collate = trainer.data_collator

    def recording(examples: list[dict]) -> dict:
        seen.extend(tuple(e["input_ids"]) for e in examples)
        return collate(examples)

    trainer.data_collator = recording
    trainer.train()
    from torch.distributed.tensor import DTensor

    params = list(trainer.model.parameters())
    return {
        "num_processes": trainer.accelerator.num_processes,
        "world_size": trainer.args.world_size,
        "wrapper": type(trainer.model_wrapped).__name__,
        "fsdp2": all(isinstance(p, DTensor) for p in params),
        "zero3": all(hasattr(p, "ds_id") for p in params),
        "seen": seen,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("technique", "wrapper", "adapted"),
    [
        ("ddp", "DistributedDataParallel", "use_cpu=True"),
        ("fsdp", "FSDPLlamaForCausalLM", "FSDP2"),
        ("zero3", "DeepSpeedEngine", "no compiled fused Adam"),
    ],
)
def test_sft_trainer_cell_trains_over_both_ranks(
    tmp_path, cpu_fallback, caplog, technique, wrapper, adapted
):
    with caplog.at_level(logging.WARNING, logger="trainflow.launch"):
        results = sft_cell.distributed(str(tmp_path / "out"), technique)
    for rank in results:
        assert rank["num_processes"] == 2 and rank["world_size"] == 2
        assert rank["wrapper"] == wrapper
        assert rank["losses"][-1] < rank["losses"][0] * 0.9
    assert results[0]["fsdp2"] == results[1]["fsdp2"] == (technique == "fsdp")
    assert results[0]["zero3"] == results[1]["zero3"] == (technique == "zero3")
    first, second = (set(r["seen"]) for r in results)
    assert len(first) == len(second) == 32 and not first & second  # one epoch, split in two
    # One warning, at the end, names what the fallback changed.
    warnings = [r.getMessage() for r in caplog.records if "adaptations" in r.getMessage()]
    assert len(warnings) == 1 and adapted in warnings[0]


def test_deepspeed_cell_compiles_nothing(tmp_path, cpu_fallback):
    """A plain ZeRO-3 engine with DeepSpeed's own AdamW: no C++ op is built on CPU ranks."""

    @distributed(gpus=2, gpu_type="H100", env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    def zero3_engine() -> dict:
        import deepspeed

        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        config = {**DEEPSPEED_ZERO3, "bf16": {"enabled": False}, "train_batch_size": 8}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01}}
        del config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        gen = torch.Generator().manual_seed(engine.global_rank)
        x = torch.randn(4, 8, generator=gen)  # one fixed batch per rank: the loss must fall
        losses = []
        for _ in range(20):
            loss = torch.nn.functional.mse_loss(engine(x), x.sum(-1, keepdim=True))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return {
            "world": engine.world_size,
            "stage": engine.zero_optimization_stage(),
            "optimizer": type(engine.optimizer.optimizer).__module__,
            "losses": losses,
        }

    for rank in zero3_engine.distributed():
        assert rank["world"] == 2 and rank["stage"] == 3
        assert rank["optimizer"].startswith("torch.optim")  # not deepspeed.ops (compiled)
        assert sum(rank["losses"][-5:]) < sum(rank["losses"][:5])
    assert not any((tmp_path / "ext").rglob("*.so")), "DeepSpeed compiled an op"


@distributed(gpus=2, gpu_type="H100")
def lightning_cell() -> dict:
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(8, 1)
            self.losses: list[float] = []
            self.seen: list[int] = []

        def training_step(self, batch, batch_idx):
            x, y, index = batch
            self.seen += index.tolist()
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen)
    data = DataLoader(TensorDataset(x, x.sum(-1, keepdim=True), torch.arange(64)), batch_size=4)
    module = Regression()
    trainer = L.Trainer(
        accelerator="gpu",
        devices="auto",
        strategy="ddp",
        precision="bf16-mixed",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, data)
    return {"world": trainer.world_size, "seen": module.seen, "losses": module.losses}


@pytest.mark.slow
def test_lightning_cell_with_devices_auto_trains_over_both_ranks(cpu_fallback):
    results = lightning_cell.distributed()
    for rank in results:
        assert rank["world"] == 2
        assert sum(rank["losses"][-3:]) < sum(rank["losses"][:3])
    first, second = (set(r["seen"]) for r in results)
    assert len(first) == len(second) == 32 and not first & second


@distributed(gpus=2, gpu_type="H100")
def torch_cell() -> dict:
    """The catalogue's plain DDP cell: nccl, set_device, device_ids, bf16 autocast."""
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    model = DDP(nn.Linear(8, 1), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen)
    dataset = TensorDataset(x, x.sum(-1, keepdim=True), torch.arange(64))
    loader = DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset))
    losses, seen, autocast_dtypes = [], [], set()
    for _ in range(3):
        for xb, yb, index in loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(xb)
                autocast_dtypes.add(out.dtype)
            loss = nn.functional.mse_loss(out.float(), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            seen += index.tolist()
    world, backend = dist.get_world_size(), dist.get_backend()
    dist.destroy_process_group()
    return {
        "world": world,
        "backend": backend,
        "seen": seen[:32],
        "losses": losses,
        "dtypes": sorted(map(str, autocast_dtypes)),
    }


def test_torch_cell_that_asks_for_nccl_runs_on_gloo(cpu_fallback):
    results = torch_cell.distributed()
    for rank in results:
        assert rank["world"] == 2 and rank["backend"] == "gloo"
        assert rank["dtypes"] == ["torch.bfloat16"]  # autocast ran, on the CPU
        assert sum(rank["losses"][-3:]) < sum(rank["losses"][:3])
    first, second = (set(r["seen"]) for r in results)
    assert len(first) == len(second) == 32 and not first & second


def test_gpu_code_without_the_fallback_is_refused_before_any_rank_starts(monkeypatch):
    from trainflow import ResourceError

    monkeypatch.delenv("TRAINFLOW_CPU_FALLBACK", raising=False)
    with pytest.raises(ResourceError, match="TRAINFLOW_CPU_FALLBACK=1"):
        torch_cell.distributed()
    assert not (Path(os.environ["TRAINFLOW_HOME"]) / "runs").exists()


def test_a_framework_left_single_process_fails_naming_it():
    """accelerate with the CPU flag taken away sees one process: it must not train 2 copies."""

    @distributed(gpus=2, gpu_type="cpu")
    def single_process_accelerate() -> int:
        from accelerate import PartialState

        del os.environ["ACCELERATE_USE_CPU"]
        return PartialState().num_processes

    with pytest.raises(RankError, match=r"Hugging Face accelerate set itself up for 1 process"):
        single_process_accelerate.distributed()


# --- remote= ------------------------------------------------------------------------------


def test_remote_false_runs_here():
    @distributed(gpus=2, gpu_type="cpu", remote=False)
    def where() -> int:
        return os.getppid()

    assert len(where.distributed()) == 2


def test_remote_true_without_a_deployment_names_what_to_set(monkeypatch):
    for name in ("TRAINFLOW_REMOTE_DEPLOYMENT", "TRAINFLOW_REMOTE_DEPLOYMENT_H100"):
        monkeypatch.delenv(name, raising=False)

    @distributed(gpus=8, gpu_type="H100", remote=True)
    def run_train() -> None: ...

    with pytest.raises(RemoteNotConfiguredError) as caught:
        run_train.distributed()
    message = str(caught.value)
    assert "TRAINFLOW_REMOTE_DEPLOYMENT_H100 or TRAINFLOW_REMOTE_DEPLOYMENT" in message
    assert "flows/remote.py:remote_call" in message
    assert not (Path(os.environ["TRAINFLOW_HOME"]) / "runs").exists()  # nothing started


def test_remote_deployment_for_the_gpu_type_wins(monkeypatch):
    from trainflow.launch.backends import remote_deployment

    monkeypatch.setenv("TRAINFLOW_REMOTE_DEPLOYMENT", "remote-call/default")
    monkeypatch.setenv("TRAINFLOW_REMOTE_DEPLOYMENT_H100", "remote-call/h100")
    assert remote_deployment("H100") == "remote-call/h100"
    assert remote_deployment("A10") == "remote-call/default"


def test_unknown_decorator_argument_is_refused_by_name():
    with pytest.raises(TypeError, match="run_async"):
        distributed(gpus=2, gpu_type="cpu", run_async=True)  # type: ignore[call-arg]


# --- return values and tracebacks -----------------------------------------------------------


def test_unpicklable_return_value_names_the_field_and_keeps_the_tensors():
    @distributed(gpus=2, gpu_type="cpu")
    def returns_a_lock() -> dict:
        model = torch.nn.Linear(2, 1)
        return {"weights": torch.ones(3), "model": model, "state": {"lock": threading.Lock()}}

    with pytest.raises(RankError) as caught:
        returns_a_lock.distributed()
    message = str(caught.value)
    assert "result['state']['lock'] (lock) cannot be pickled" in message
    kept = Path(message.split("kept in ")[1].split(" ")[0])
    saved = torch.load(kept)
    assert torch.equal(saved["result['weights']"], torch.ones(3))
    assert set(saved["result['model'].state_dict()"]) == {"weight", "bias"}


MAIN_SCRIPT = textwrap.dedent(
    """
    import traceback
    from trainflow import RankError, distributed

    def helper(x):
        return 1 / x  # the line that fails

    @distributed(gpus=2, gpu_type="cpu")
    def cell(x):
        try:
            return helper(x)
        except ZeroDivisionError:
            traceback.print_exc()  # printed on the rank, as a framework's logger would
            raise

    try:
        cell.distributed(0)
    except RankError as error:
        print("CALLER SAW:", error)
    """
)


def test_traceback_of_a_function_defined_in_main_shows_its_source(tmp_path):
    script = tmp_path / "notebook_cell.py"
    script.write_text(MAIN_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    ).stdout
    rank_part, caller_part = out.split("CALLER SAW:")
    # The rank's own output and the caller's error both name the file and show the line.
    for part in (rank_part, caller_part):
        assert f'File "{script}", line 6, in helper' in part
        assert "return 1 / x  # the line that fails" in part
    assert "<dynamic-code>" not in out
