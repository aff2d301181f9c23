"""Values the ranks would fail on are usage errors of the command line, before anything starts:
exit 2 with a message naming the option, no Prefect server, no MLflow store or run, no launch.

Through each pipeline's real command line (`flows.command.main`, as `python -m flows.<name>`
runs it), and once as a real process.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from flows import command
from tests.conftest import REPO_ROOT
from trainflow import tracking

BETAS = "--training-optimizer-betas"


def _refused(capsys, name: str, *argv: str) -> str:
    """Run pipeline `name`'s command line; assert it exits 2 having started nothing."""
    with pytest.raises(SystemExit) as exit_info:
        command.main(name, list(argv))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Starting temporary server" not in err
    db = tracking.tracking_uri().removeprefix("sqlite:///")
    assert not Path(db).exists(), "the MLflow store was opened"
    return err


@pytest.mark.parametrize(
    ("name", "argv", "names"),
    [
        ("transformer", (BETAS, "[1.5, 0.9]"), f"{BETAS}: 0: Input should be less than 1"),
        ("sft", (BETAS, "[0.9, 1.0]"), f"{BETAS}: 1: Input should be less than 1"),
        ("detection", (BETAS, "[-0.1, 0.9]"), f"{BETAS}: 0: Input should be greater than"),
        ("two_tower", (BETAS, "[0.9, 2]"), f"{BETAS}: 1: Input should be less than 1"),
    ],
)
def test_adam_betas_outside_0_1_are_refused_naming_the_option(capsys, name, argv, names):
    assert names in _refused(capsys, name, *argv)


def test_more_key_tokens_than_the_vocabulary_holds_is_refused(capsys):
    err = _refused(capsys, "transformer", "--data-num-key-tokens", "300")
    assert "model.num_classes=4 x data.num_key_tokens=300" in err
    assert "model.vocab_size=1024" in err
    assert "Value error" not in err  # the check's own words, not pydantic's wrapping


def test_a_batch_larger_than_the_train_split_is_refused_before_the_server(capsys):
    err = _refused(capsys, "two_tower", "--training-batch-size", "100000")
    assert "training.batch_size=100000 x gpus=2 exceeds the train split" in err


@pytest.mark.parametrize(
    ("name", "argv", "names"),
    [
        ("mlp", ("--learning-rate", "0"), "--learning-rate: Input should be greater than 0"),
        ("mlp", ("--batch-size", "8192"), "batch_size=8192 x gpus=2 exceeds"),
        ("sft", ("--training-optimizer-learning-rate", "-1"), "--training-optimizer-learning-rate"),
        ("transformer", ("--training-grad-accum-steps", "3"), "training.grad_accum_steps=3"),
        ("detection", ("--training-global-batch-size", "512"), "exceeds data.num_train_images"),
    ],
)
def test_other_values_the_ranks_would_fail_on_are_refused(capsys, name, argv, names):
    assert names in _refused(capsys, name, *argv)


@pytest.mark.parametrize(
    ("name", "argv", "names"),
    [
        (
            "sft",
            ("--async-checkpoints", "--technique", '{"name": "fsdp"}'),
            "async_checkpoints: technique 'fsdp' writes its checkpoints at once; background "
            "checkpoints are for ddp",
        ),
        ("two_tower", ("--async-checkpoints",), "its framework's own trainer"),
        (
            "transformer",
            ("--async-checkpoints", "--technique", '{"name": "deepspeed", "zero_stage": 3}'),
            "async_checkpoints: technique 'deepspeed' writes its checkpoints at once",
        ),
    ],
)
def test_background_checkpoints_where_nothing_writes_them_are_refused(capsys, name, argv, names):
    assert names in _refused(capsys, name, *argv)


def test_the_command_exits_2_in_one_line_without_a_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "flows.two_tower", "--training-batch-size", "100000"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "Starting temporary server" not in proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [
        "python -m flows.two_tower: error: training.batch_size=100000 x gpus=2 exceeds the "
        "train split of 'interactions' (16200 rows): no full step fits"
    ]
