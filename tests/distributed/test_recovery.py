"""A rank SIGKILLed mid-training: torch elastic restarts the ranks, they continue from the last
checkpoint, and the run ends as if nothing happened.

Tolerance: the restarted run redoes the steps after the checkpoint on the same data with the
same optimizer state and RNG streams; with fp32 DDP on gloo the result is expected bit-equal, and
is asserted within WEIGHT_ATOL.
"""

import json
import random
from pathlib import Path

import pytest
import torch

from benchmarks.recovery import KILL_ENV, train_and_die
from trainflow import checkpoint, launch
from trainflow.configs.mlp import MLPConfig
from trainflow.strategies.job import Workload, run_on_rank
from trainflow.strategies.loop import read_sample_log
from trainflow.workloads.mlp import build_model, sample_log_path

WEIGHT_ATOL = 1e-6
CHECKPOINT_EVERY = 10


def config(async_checkpoints: bool = False) -> MLPConfig:
    # 2 ranks x 1024 rows / 32 = 32 steps an epoch; 2 epochs: the kill may land in either.
    return MLPConfig(
        async_checkpoints=async_checkpoints,
        num_train_samples=2048,
        batch_size=32,
        num_epochs=2,
        log_every=5,
        checkpoint_every=CHECKPOINT_EVERY,
        keep_checkpoints=2,
        log_samples=True,
        gpu_type="cpu",
        timeout_s=300,
        max_restarts=1,
    )


def run(output_dir: Path, kill_after: int = 0, async_checkpoints: bool = False) -> list:
    cfg = config(async_checkpoints)
    workload = Workload(
        train_fn=train_and_die,
        model_fn=build_model,
        config=cfg,
        output_dir=str(output_dir),
        resume_from=str(output_dir / "checkpoints"),
    )
    options = cfg.resources.launch_options()
    options = type(options)(**{**options.__dict__, "env": {KILL_ENV: str(kill_after)}})
    return launch(run_on_rank, (workload, cfg.technique), options=options).values


def assert_same_samples_and_weights(out: Path, reference_dir: Path) -> None:
    """Same samples at every step as the uninterrupted run on each rank (nothing repeated or
    skipped), and the same final weights."""
    for rank in (0, 1):
        assert read_sample_log(sample_log_path(out, rank)) == read_sample_log(
            sample_log_path(reference_dir, rank)
        )
    got = torch.load(out / "model.pt", weights_only=True)
    want = torch.load(reference_dir / "model.pt", weights_only=True)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=WEIGHT_ATOL, rtol=0)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAINFLOW_HOME", str(out / "home"))
        result = run(out)[0]
    return out, result


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_rank_killed_mid_training_restarts_from_the_checkpoint_and_ends_identical(
    uninterrupted, tmp_path, seed
):
    reference_dir, reference = uninterrupted
    total = reference.steps
    kill_after = random.Random(seed).randrange(CHECKPOINT_EVERY + 1, total - 2)
    result = run(tmp_path, kill_after)[0]

    assert result.steps == total
    # The restart continued from the last checkpoint at or before the kill, not from step 0.
    resumed_at = (kill_after // CHECKPOINT_EVERY) * CHECKPOINT_EVERY
    for rank in (0, 1):
        lines = sample_log_path(tmp_path, rank).read_text().splitlines()
        records = [json.loads(line) for line in lines]
        steps = [r["step"] for r in records]
        restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
        assert steps[restart] == resumed_at + 1, f"rank {rank} restarted at step {steps[restart]}"
        assert steps[restart:] == list(range(resumed_at + 1, total + 1))
    assert_same_samples_and_weights(tmp_path, reference_dir)
    # The restarted attempt logged the same losses as the uninterrupted run from its restart on.
    assert min(result.history) > resumed_at
    assert result.history == {s: reference.history[s] for s in result.history}
    kept = checkpoint.complete_checkpoints(tmp_path / "checkpoints")
    every_tenth_and_last = sorted({*range(CHECKPOINT_EVERY, total + 1, CHECKPOINT_EVERY), total})
    assert [checkpoint.read_meta(p)["step"] for p in kept] == every_tenth_and_last[-2:]
    assert not list((tmp_path / "checkpoints").glob(".*.partial"))


def test_with_background_checkpoints_a_killed_rank_resumes_from_a_whole_one_and_ends_identical(
    uninterrupted, tmp_path
):
    # The kill lands 1 step after a checkpoint began: written in the background, it may not
    # be whole yet, and then the one before it is where the restart continues from.
    reference_dir, reference = uninterrupted
    total = reference.steps
    kill_after = 2 * CHECKPOINT_EVERY + 1
    result = run(tmp_path, kill_after, async_checkpoints=True)[0]

    assert result.steps == total
    steps = [
        json.loads(line)["step"] for line in sample_log_path(tmp_path, 0).read_text().splitlines()
    ]
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[restart] - 1 in (CHECKPOINT_EVERY, 2 * CHECKPOINT_EVERY)
    assert_same_samples_and_weights(tmp_path, reference_dir)
    kept = checkpoint.complete_checkpoints(tmp_path / "checkpoints")
    every_tenth_and_last = sorted({*range(CHECKPOINT_EVERY, total + 1, CHECKPOINT_EVERY), total})
    assert [checkpoint.read_meta(p)["step"] for p in kept] == every_tenth_and_last[-2:]
    assert not list((tmp_path / "checkpoints").glob(".*.partial"))
