"""What a notebook user of the CPU fallback runs into, on 2 real gloo CPU ranks.

Code written for a managed notebook's GPUs (`gpu_type="H100"`) runs here with
TRAINFLOW_CPU_FALLBACK=1: accelerate's own self-tests, a TRL FSDP run that saves its model,
Lightning reading MDS shards, a `.to("cuda:N")`, and a process group the cell opens itself.
"""

import os
import time

import pytest
import torch

from tests.conftest import REPO_ROOT
from trainflow import RankError, distributed
from trainflow.errors import HangError


@pytest.fixture
def cpu_fallback(monkeypatch):
    monkeypatch.setenv("TRAINFLOW_CPU_FALLBACK", "1")


# --- accelerate's self-tests ----------------------------------------------------------------


@distributed(gpus=2, gpu_type="H100")
def accelerate_self_test(script: str) -> str:
    """One of the scripts accelerate ships to test a distributed setup (`accelerate test`)."""
    import importlib

    module = importlib.import_module(f"accelerate.test_utils.scripts.{script}")
    if script != "test_ops":
        module.main()
        return script
    # test_ops's main() as accelerate 1.8 to 1.13 ship it (the Axolotl and LLM Foundry
    # environments): a bare PartialState(), with no `cpu=` from the environment.
    from accelerate import PartialState

    state = PartialState()
    for name in [n for n in dir(module) if n.startswith("test_")]:  # gather, reduce, ...
        getattr(module, name)(state)
    state.destroy_process_group()
    return f"{script} on {state.num_processes} {state.device.type} processes"


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("test_ops", "test_ops on 2 cpu processes"),
        ("test_sync", "test_sync"),
        ("test_script", "test_script"),
    ],
)
def test_accelerate_self_tests_pass_on_cpu_fallback_ranks(cpu_fallback, script, expected):
    assert accelerate_self_test.distributed(script) == [expected, expected]


# --- TRL with FSDP: save_model and bf16 -----------------------------------------------------

TOKENIZER = str(REPO_ROOT / "data" / "tokenizer")
ROWS = [{"text": f"question {i}: what is {i} plus {i}? answer: {2 * i}"} for i in range(32)]


@distributed(gpus=2, gpu_type="H100")
def fsdp_sft_then_save(output_dir: str) -> dict:
    """The TRL cell of a managed notebook: FSDP, bf16, and `save_model` at the end."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from trainflow.models.causal_lm import model_config

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    model = AutoModelForCausalLM.from_config(model_config("tiny-llama", tokenizer))
    args = SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        max_steps=2,
        bf16=True,
        fsdp="full_shard auto_wrap",
        fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        save_strategy="no",
        report_to="none",
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    computed_in: set[str] = set()  # the dtype a sharded layer's weight has in its forward
    layer = trainer.model.model.layers[0].self_attn.q_proj
    layer.register_forward_pre_hook(lambda m, _: computed_in.add(str(m.weight.dtype)))
    trainer.train()
    trainer.save_model(output_dir)
    return {"sharded": type(trainer.model_wrapped).__name__, "computed_in": sorted(computed_in)}


@pytest.mark.slow
def test_trl_fsdp_keeps_bf16_and_saves_a_model_from_pretrained_loads(tmp_path, cpu_fallback):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "model"
    for rank in fsdp_sft_then_save.distributed(str(out)):
        assert rank == {"sharded": "FSDPLlamaForCausalLM", "computed_in": ["torch.bfloat16"]}
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"]  # every weight came from the file
    assert type(model).__name__ == "LlamaForCausalLM"


# --- a process group the cell opens itself ---------------------------------------------------


@distributed(gpus=2, gpu_type="H100", collective_timeout=3)
def waits_for_a_silent_peer() -> None:
    """A cell that opens its own group; rank 1 then stops answering (a stuck data loader)."""
    import time

    import torch.distributed as dist

    dist.init_process_group("nccl")
    if dist.get_rank() == 1:
        time.sleep(40)
    dist.all_reduce(torch.ones(1))


def test_collective_timeout_bounds_a_group_the_cell_opens_itself(cpu_fallback):
    start = time.monotonic()
    with pytest.raises(HangError) as caught:
        waits_for_a_silent_peer.distributed()
    # Rank 0 gave up after the launch's 3 s, not torch's 30 minutes (nor rank 1's 40 s).
    assert time.monotonic() - start < 30
    assert "rank 1 stopped answering: rank 0 timed out after 3s" in str(caught.value)


# --- a tensor moved to "cuda:N" ---------------------------------------------------------------


@distributed(gpus=2, gpu_type="H100")
def moves_to_cuda() -> float:
    local_rank = int(os.environ["LOCAL_RANK"])
    return torch.ones(2).to(f"cuda:{local_rank}").sum().item()


def test_moving_a_tensor_to_cuda_names_the_fallback_and_what_to_change(cpu_fallback):
    with pytest.raises(RankError) as caught:
        moves_to_cuda.distributed()
    message = str(caught.value).splitlines()[0]
    assert "has no CUDA device: this launch is the CPU fallback" in message
    assert "TRAINFLOW_CPU_FALLBACK=1" in message and "trainflow.runtime.get_device()" in message
    assert "spawn" not in message  # torch's own: "Cannot re-initialize CUDA in forked ..."


# --- Lightning reading MDS -------------------------------------------------------------------


@distributed(gpus=2, gpu_type="H100")
def lightning_reads_mds(path: str) -> dict:
    """A Lightning cell over MDS shards as written for GPUs: no process group set up first."""
    import lightning as L
    from streaming import StreamingDataset
    from torch import nn
    from torch.utils.data import DataLoader

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(1, 1)
            self.seen: list[int] = []

        def training_step(self, batch, batch_idx):
            self.seen += batch["x"].tolist()
            x = batch["x"].float().unsqueeze(-1)
            return nn.functional.mse_loss(self.net(x), 2 * x)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    dataset = StreamingDataset(local=path, batch_size=4, shuffle=False)
    module = Regression()
    trainer = L.Trainer(
        accelerator="gpu",
        devices="auto",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, DataLoader(dataset, batch_size=4))
    return {"world": trainer.world_size, "seen": module.seen}


def test_lightning_reads_mds_without_a_group_opened_first(tmp_path, cpu_fallback):
    from streaming import MDSWriter

    with MDSWriter(out=str(tmp_path / "mds"), columns={"x": "int"}) as writer:
        for i in range(64):
            writer.write({"x": i})
    results = lightning_reads_mds.distributed(str(tmp_path / "mds"))
    assert [rank["world"] for rank in results] == [2, 2]
    first, second = (set(rank["seen"]) for rank in results)
    assert len(first) == len(second) == 32 and first | second == set(range(64))
