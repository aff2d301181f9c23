"""Real 2-rank gloo runs of every technique against a single-process reference.

Tolerance: with fp32 and a fixed seed, each logged loss matches the single-process run on the
same global batch within LOSS_RTOL (only the order of the gradient reduction differs).
"""

from pathlib import Path

import pytest
import torch

from trainflow import checkpoint, launch, runtime
from trainflow.strategies import (
    DDPConfig,
    DeepSpeedConfig,
    FSDPConfig,
    TechniqueConfig,
    build_strategy,
)
from trainflow.strategies.base import adamw
from trainflow.strategies.job import TrainResult, Workload, local_path, run_on_rank
from trainflow.workloads.transformer import (
    TransformerConfig,
    build_model,
    compute,
    global_batch,
    train,
)

LOSS_RTOL = 1e-4
OUTPUT_ATOL = 1e-4
TINY = {"vocab_size": 64, "seq_len": 8, "d_model": 32, "num_heads": 2, "num_layers": 2, "d_ff": 64}


def tiny_config(
    technique: TechniqueConfig, gpus: int = 2, checkpoint_every: int = 0, **training
) -> TransformerConfig:
    return TransformerConfig(
        model=TINY,
        training={"num_steps": 6, "global_batch_size": 8, "log_every": 1} | training,
        technique=technique,
        gpus=gpus,
        gpu_type="cpu",
        timeout_s=300,
        checkpoint_every=checkpoint_every,
    )


def run(config: TransformerConfig, output_dir: Path, resume_from: str | None = None):
    workload = Workload(
        train_fn=train,
        model_fn=build_model,
        config=config,
        output_dir=str(output_dir),
        resume_from=resume_from,
    )
    options = config.resources.launch_options()
    return launch(run_on_rank, (workload, config.technique), options=options).values


def reference(config: TransformerConfig) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """Plain single-process training on each step's whole global batch."""
    torch.manual_seed(config.training.seed)
    model = build_model(config)
    optimizer = adamw(model.parameters(), config.training.optimizer)
    losses = {}
    for step in range(1, config.training.num_steps + 1):
        loss = compute(model, global_batch(config, step))["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses[step] = loss.item()
    return losses, model.state_dict()


def losses(result: TrainResult) -> dict[int, float]:
    return {step: metrics["loss"] for step, metrics in result.history.items()}


def assert_close_losses(got: dict[int, float], expected: dict[int, float]) -> None:
    assert got.keys() == expected.keys()
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=LOSS_RTOL), f"step {step}"


def assert_exported_model(
    result: TrainResult, config, expected: dict[str, torch.Tensor], atol: float = OUTPUT_ATOL
):
    """The export is a plain state dict: it loads strictly into the bare model class and
    predicts what the reference model predicts. (Outputs, not weights: the attention key bias
    gets no gradient, and Adam turns its rounding noise into lr-sized steps.)"""
    state = torch.load(local_path(result.model_uri), map_location="cpu", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    model, reference_model = build_model(config), build_model(config)
    model.load_state_dict(state, strict=True)
    reference_model.load_state_dict(expected)
    tokens, _ = global_batch(config, step=1000)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference_model(tokens), atol=atol, rtol=0)


def test_ddp_with_grad_accumulation_matches_single_process(tmp_path):
    config = tiny_config(DDPConfig(bucket_cap_mb=1), grad_accum_steps=2, checkpoint_every=0)
    rank0, rank1 = run(config, tmp_path)
    expected_losses, expected_state = reference(config)
    assert rank0.technique == "ddp" and rank0.world_size == 2 and rank0.steps == 6
    assert rank0.history == rank1.history  # logged values are reduced over ranks
    assert_close_losses(losses(rank0), expected_losses)
    assert_exported_model(rank0, config, expected_state)
    assert rank0.checkpoint_uri is None  # checkpoint_every=0


def test_fsdp_matches_single_process_and_resumes_on_one_rank(tmp_path):
    config = tiny_config(FSDPConfig(), checkpoint_every=3)
    two_ranks = run(config, tmp_path / "two")[0]
    expected_losses, expected_state = reference(config)
    assert_close_losses(losses(two_ranks), expected_losses)
    assert_exported_model(two_ranks, config, expected_state)
    saved = tmp_path / "two" / "checkpoints" / "step_000003"
    assert checkpoint.read_meta(saved) == {"step": 3, "technique": "fsdp", "world_size": 2}
    assert local_path(two_ranks.checkpoint_uri).name == "step_000006"

    # The sharded checkpoint of 2 ranks loads into 1 rank and training continues alike.
    one_rank = run(tiny_config(FSDPConfig(), gpus=1), tmp_path / "one", resume_from=str(saved))[0]
    assert one_rank.world_size == 1 and sorted(one_rank.history) == [4, 5, 6]
    assert_close_losses(losses(one_rank), {s: expected_losses[s] for s in (4, 5, 6)})
    assert_exported_model(one_rank, config, expected_state)


@pytest.mark.parametrize("technique", [DDPConfig(), FSDPConfig()], ids=["ddp", "fsdp"])
def test_background_checkpoints_hold_the_state_of_their_step_and_resume_exactly(
    tmp_path, technique
):
    # Steps 2 and 4 are written in the background while steps 3 to 6 change the weights in
    # place: each checkpoint must hold its own step's state (staged before training went on).
    config = tiny_config(technique, checkpoint_every=2).model_copy(
        update={"async_checkpoints": True, "keep_checkpoints": 3}
    )
    two_ranks = run(config, tmp_path / "two")[0]
    expected_losses, expected_state = reference(config)
    assert_close_losses(losses(two_ranks), expected_losses)
    root = tmp_path / "two" / "checkpoints"
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == [
        "step_000002",
        "step_000004",
        "step_000006",
    ]
    assert not list(root.glob(".*.partial"))
    one_rank = run(
        tiny_config(technique, gpus=1), tmp_path / "one", resume_from=str(root / "step_000004")
    )[0]
    assert sorted(one_rank.history) == [5, 6]
    assert_close_losses(losses(one_rank), {s: expected_losses[s] for s in (5, 6)})
    assert_exported_model(one_rank, config, expected_state)


def zero_train_then_resume(config: TransformerConfig, output_dir: str) -> dict:
    """On each rank: per ZeRO stage, train with checkpoints, then resume a fresh engine."""
    results = {}
    with runtime.process_group():
        for stage in (1, 2, 3):
            technique = DeepSpeedConfig(zero_stage=stage)
            full_dir, resumed_dir = Path(output_dir, f"zero{stage}"), Path(output_dir, "resumed")
            full = train(config, build_strategy(technique), output_dir=str(full_dir))
            resumed = train(
                config,
                build_strategy(technique),
                output_dir=str(resumed_dir / str(stage)),
                resume_from=str(full_dir / "checkpoints" / "step_000002"),
            )
            results[stage] = (full, resumed)
    return results


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """One launch runs ZeRO-1, 2 and 3 (DeepSpeed's import and setup dominate each launch)."""
    out = tmp_path_factory.mktemp("zero")
    config = tiny_config(DeepSpeedConfig(), num_steps=4, checkpoint_every=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAINFLOW_HOME", str(out / "home"))
        options = config.resources.launch_options()
        values = launch(zero_train_then_resume, (config, str(out)), options=options).values
    return config, values[0], reference(config)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_trains_checkpoints_and_resumes(zero_runs, stage):
    config, results, (expected_losses, expected_state) = zero_runs
    full, resumed = results[stage]
    assert full.technique == "deepspeed" and full.steps == 4
    # DeepSpeed keeps flat fp32 partitions and reduces in its own order: a looser match.
    for step, loss in losses(full).items():
        assert loss == pytest.approx(expected_losses[step], rel=1e-3), f"step {step}"
    assert sorted(resumed.history) == [3, 4]
    for step, loss in losses(resumed).items():
        assert loss == pytest.approx(losses(full)[step], rel=LOSS_RTOL), f"step {step}"
    # Resuming changes nothing: both exports predict alike, and close to the reference.
    resumed_state = torch.load(local_path(resumed.model_uri), weights_only=True)
    assert_exported_model(full, config, resumed_state)
    assert_exported_model(full, config, expected_state, atol=0.05)
    meta = checkpoint.read_meta(local_path(full.checkpoint_uri))
    assert meta == {"step": 4, "technique": "deepspeed", "world_size": 2}
