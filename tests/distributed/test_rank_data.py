"""A rank trains only on its own partition: through our loop and through the HF Trainer.

Two real gloo ranks train on a prepared chat split of 128 samples for two epochs; every batch
a training step consumed is recorded with its sample ids. In each epoch the ranks' ids are
disjoint and together they are the whole split, once.
"""

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.conftest_data import chat_config
from trainflow import checkpoint, launch
from trainflow.configs.sft import SFTJob, load_sft_preset
from trainflow.data import LoaderConfig, build_dataloader, prepare_dataset
from trainflow.strategies import DDPConfig, FSDPConfig, OptimizerConfig, build_strategy
from trainflow.strategies.job import Workload, run_on_rank

pytestmark = pytest.mark.slow

NUM_SAMPLES = 128
BATCH = 8
STEPS_PER_EPOCH = NUM_SAMPLES // (2 * BATCH)


def ids_through_our_loop(uri: str) -> list[list[int]]:
    """Rank function: DDP + `fit` over this rank's loader; the ids of each micro-batch."""
    from trainflow import runtime
    from trainflow.strategies.loop import Schedule, fit
    from trainflow.tracking import NullSink

    with runtime.process_group():
        strategy = build_strategy(DDPConfig())
        strategy.wrap(
            torch.nn.Linear(1, 1), OptimizerConfig(), micro_batch_size=BATCH, grad_accum_steps=1
        )
        loader = build_dataloader(uri, "train", LoaderConfig(batch_size=BATCH, seed=3))
        batches = ([b] for epoch in range(2) for b in loader)
        seen: list[list[int]] = []

        def compute(model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
            seen.append(batch["id"].tolist())
            return {"loss": model(batch["input_ids"][:, :1].float()).pow(2).mean()}

        steps = 2 * len(loader)
        fit(strategy, lambda _: next(batches), compute, Schedule(steps, 1, 0), NullSink(), Path())
        return seen


def ids_through_the_trainer(job: SFTJob, strategy: Any, **kwargs: Any) -> dict[str, Any]:
    """Rank function: the SFT workload's `train`, recording the batches the Trainer drew."""
    from trainflow.workloads import sft

    sft.sample_log.start()
    result = sft.train(job, strategy, **kwargs)
    return {"ids": sft.sample_log.ids, "result": result}


def _per_epoch(ranks: list[list[list[int]]]) -> list[list[set[int]]]:
    """For each epoch, each rank's set of ids (STEPS_PER_EPOCH batches an epoch)."""
    epochs = []
    for start in range(0, len(ranks[0]), STEPS_PER_EPOCH):
        epochs.append([set(itertools.chain(*r[start : start + STEPS_PER_EPOCH])) for r in ranks])
    return epochs


def _assert_partitioned(ranks: list[list[list[int]]], all_ids: set[int]) -> None:
    assert [len(r) for r in ranks] == [2 * STEPS_PER_EPOCH] * 2
    for rank0, rank1 in _per_epoch(ranks):
        assert rank0.isdisjoint(rank1)
        assert rank0 | rank1 == all_ids
        assert len(rank0) == len(rank1) == NUM_SAMPLES // 2


@pytest.fixture(scope="module")
def chat_split(tmp_path_factory):
    data = prepare_dataset(chat_config(tmp_path_factory.mktemp("chat"), num_rows=NUM_SAMPLES))
    assert data.splits["train"].num_samples == NUM_SAMPLES
    loader = build_dataloader(data.uri, "train", LoaderConfig(batch_size=64, shuffle=False))
    return data, {i for batch in loader for i in batch["id"].tolist()}


def test_each_rank_reads_its_own_partition_through_our_loop(chat_split):
    data, all_ids = chat_split
    options = load_sft_preset("debug_cpu").resources.launch_options()
    ranks = launch(ids_through_our_loop, (data.uri,), options=options).values
    _assert_partitioned(ranks, all_ids)


@pytest.mark.parametrize("technique", [DDPConfig(), FSDPConfig()], ids=["ddp", "fsdp"])
def test_each_rank_reads_its_own_partition_through_the_trainer(chat_split, technique, tmp_path):
    data, all_ids = chat_split
    config = load_sft_preset("debug_cpu").model_copy(
        update={
            "max_steps": 2 * STEPS_PER_EPOCH,
            "technique": technique,
            "training": load_sft_preset("debug_cpu").training.model_copy(
                update={"per_device_batch_size": BATCH, "logging_steps": STEPS_PER_EPOCH}
            ),
        }
    )
    workload = Workload(
        train_fn=ids_through_the_trainer,
        model_fn="trainflow.workloads.sft:build_model",
        config=SFTJob(config=config, data=data),
        output_dir=str(tmp_path),
        framework="hf",
    )
    ranks = launch(run_on_rank, (workload, technique), options=config.resources.launch_options())
    _assert_partitioned([r["ids"] for r in ranks.values], all_ids)
    result = ranks.values[0]["result"]
    assert result.steps == 2 * STEPS_PER_EPOCH and result.world_size == 2
    # The model the Trainer trained is really wrapped by the technique, not just configured.
    expected = "DistributedDataParallel" if technique.name == "ddp" else "FSDPLlamaForCausalLM"
    assert result.wrapped_as == expected


@pytest.mark.parametrize("technique", [DDPConfig(), FSDPConfig()], ids=["ddp", "fsdp"])
def test_the_trainer_resumes_at_the_next_unseen_sample(chat_split, technique, tmp_path):
    """A run resumed from a checkpoint in its second epoch trains on exactly the batches the
    uninterrupted run trained on after that step, and logs the same losses."""
    data, _ = chat_split
    saved_at, steps = STEPS_PER_EPOCH + 1, STEPS_PER_EPOCH + 3
    preset = load_sft_preset("debug_cpu")
    config = preset.model_copy(
        update={
            "max_steps": steps,
            "checkpoint_every": saved_at,
            "technique": technique,
            "training": preset.training.model_copy(
                update={"per_device_batch_size": BATCH, "logging_steps": 1}
            ),
        }
    )

    def run(out: Path, resume_from: Path | None = None) -> list[dict[str, Any]]:
        workload = Workload(
            train_fn=ids_through_the_trainer,
            model_fn="trainflow.workloads.sft:build_model",
            config=SFTJob(config=config, data=data),
            output_dir=str(out),
            framework="hf",
            resume_from=str(resume_from) if resume_from else None,
        )
        options = config.resources.launch_options()
        return launch(run_on_rank, (workload, technique), options=options).values

    full = run(tmp_path / "full")
    saved = tmp_path / "full" / "checkpoints" / f"checkpoint-{saved_at}"
    assert checkpoint.read_meta(saved)["step"] == saved_at
    resumed = run(tmp_path / "resumed", saved)
    for rank in (0, 1):
        assert resumed[rank]["ids"] == full[rank]["ids"][saved_at:], f"rank {rank}"
    before, after = full[0]["result"].history, resumed[0]["result"].history
    assert sorted(after) == list(range(saved_at + 1, steps + 1))
    for step in after:
        assert after[step]["loss"] == pytest.approx(before[step]["loss"], rel=1e-3), step
