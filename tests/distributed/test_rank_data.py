"""A rank trains only on its own partition: through our loop and through the HF Trainer.

Two real gloo ranks train on a prepared chat split of 128 samples for two epochs; every batch
a training step consumed is recorded with its sample ids. In each epoch the ranks' ids are
disjoint and together they are the whole split, once.
"""

import itertools
import sys
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
    return {"ids": sft.sample_log.ids, "result": result, "deepspeed": "deepspeed" in sys.modules}


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
    # Saving unwraps the model (accelerate), which looks for DeepSpeed's engine only where
    # DeepSpeed is loaded: these ranks never import it.
    assert [r["deepspeed"] for r in ranks.values] == [False, False]


@pytest.mark.parametrize(
    ("technique", "background"),
    [(DDPConfig(), False), (FSDPConfig(), False), (DDPConfig(), True)],
    ids=["ddp", "fsdp", "ddp-async"],
)
def test_the_trainer_resumes_at_the_next_unseen_sample(chat_split, technique, background, tmp_path):
    """A run resumed from a checkpoint in its second epoch trains on exactly the batches the
    uninterrupted run trained on after that step, and logs the same losses.

    With `async_checkpoints`, the checkpoint written in the background while the next steps
    change the weights holds exactly its own step's state (that of a run that wrote it at
    once), and the run resumed from it ends with exactly the uninterrupted run's weights."""
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

    def run(out: Path, resume_from: Path | None = None, **update: Any) -> list[dict[str, Any]]:
        workload = Workload(
            train_fn=ids_through_the_trainer,
            model_fn="trainflow.workloads.sft:build_model",
            config=SFTJob(config=config.model_copy(update=update), data=data),
            output_dir=str(out),
            framework="hf",
            resume_from=str(resume_from) if resume_from else None,
        )
        options = config.resources.launch_options()
        return launch(run_on_rank, (workload, technique), options=options).values

    full = run(tmp_path / "full")
    saved = tmp_path / "full" / "checkpoints" / f"checkpoint-{saved_at}"
    assert checkpoint.read_meta(saved)["step"] == saved_at
    if background:
        run(tmp_path / "async", async_checkpoints=True)
        saved = tmp_path / "async" / "checkpoints" / f"checkpoint-{saved_at}"
        _assert_same_checkpoint(saved, tmp_path / "full" / "checkpoints" / saved.name)
    resumed = run(tmp_path / "resumed", saved, async_checkpoints=background)
    for rank in (0, 1):
        assert resumed[rank]["ids"] == full[rank]["ids"][saved_at:], f"rank {rank}"
    before, after = full[0]["result"].history, resumed[0]["result"].history
    assert sorted(after) == list(range(saved_at + 1, steps + 1))
    for step in after:
        assert after[step]["loss"] == pytest.approx(before[step]["loss"], rel=1e-3), step
    if background:
        _assert_same_weights(tmp_path / "resumed" / "model", tmp_path / "full" / "model")


def _assert_same_checkpoint(saved: Path, expected: Path) -> None:
    """Every file the Trainer reads back on a resume holds equal values in both folders."""
    import json

    _assert_same_weights(saved, expected)
    names = sorted(p.name for p in expected.glob("*.pt*"))
    assert "optimizer.pt" in names and "rng_state_1.pth" in names
    assert sorted(p.name for p in saved.glob("*.pt*")) == names
    for name in names:
        # Files this run wrote itself; the Trainer's RNG file holds NumPy's state.
        ours, theirs = (torch.load(p / name, weights_only=False) for p in (saved, expected))
        _assert_equal(ours, theirs, name)
    for name in ("trainer_state.json", "data_state.json"):
        ours, theirs = (_untimed(json.loads((p / name).read_text())) for p in (saved, expected))
        assert ours == theirs, name


def _untimed(state: Any) -> Any:
    """A checkpoint's JSON without the speeds the Trainer logs (`train_runtime`, ...)."""
    if isinstance(state, dict):
        return {k: _untimed(v) for k, v in state.items() if not k.startswith("train_")}
    return [_untimed(v) for v in state] if isinstance(state, list) else state


def _assert_same_weights(saved: Path, expected: Path) -> None:
    from safetensors.torch import load_file

    ours, theirs = load_file(saved / "model.safetensors"), load_file(expected / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


def _assert_equal(ours: Any, theirs: Any, where: str) -> None:
    if isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert ours.keys() == theirs.keys(), where
        for key in theirs:
            _assert_equal(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, list | tuple):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _assert_equal(a, b, f"{where}[{i}]")
    elif hasattr(theirs, "shape"):  # NumPy's RNG keys
        assert (ours == theirs).all(), where
    else:
        assert ours == theirs, where


def save_twice_rank_1_failing_the_second(root: str) -> str:
    """Rank function: two background checkpoints through `DurableCallback` (keep 1); rank 1's
    write of the second fails. What the training thread's next wait raised."""
    from types import SimpleNamespace

    from trainflow import runtime
    from trainflow.workloads.sft_checkpoints import DurableCallback

    with runtime.process_group():
        loader = SimpleNamespace(state_dict=lambda: {"samples": 1})
        durable = DurableCallback(loader, True, "ddp", keep=1, background=True)
        args, control = SimpleNamespace(output_dir=root), SimpleNamespace()
        durable.on_train_begin(args, None, control)
        for step in (2, 4):
            durable.saves.wait()
            folder = Path(root) / f"checkpoint-{step}"
            rank = runtime.get_global_rank()

            def write(folder: Path = folder, rank: int = rank, step: int = step) -> None:
                folder.mkdir(parents=True, exist_ok=True)
                if step == 4 and rank == 1:
                    raise OSError("disk full")
                (folder / f"part_{rank}").write_text("x")

            durable.saves.add(write)
            durable.on_save(args, SimpleNamespace(global_step=step, max_steps=10), control)
        try:
            durable.saves.wait()
        except RuntimeError as exc:
            return str(exc)
        return ""


def test_a_background_checkpoint_not_written_on_every_rank_is_never_resumed_from(tmp_path):
    options = load_sft_preset("debug_cpu").resources.launch_options()
    errors = launch(save_twice_rank_1_failing_the_second, (str(tmp_path),), options=options)
    assert "disk full" in errors.values[1]
    assert "checkpoint-4 was not written on every rank" in errors.values[0]
    assert not (tmp_path / "checkpoint-4" / checkpoint.MARKER).exists()
    # The older checkpoint is kept: only a complete newer one replaces it.
    assert checkpoint.resolve(tmp_path) == tmp_path / "checkpoint-2"
