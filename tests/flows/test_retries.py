"""The training task is retried after failures a relaunch can fix, never after bugs.

Real Prefect runs of a technique subflow, real ranks; each attempt is one launch, and every
launch leaves its own run folder under TRAINFLOW_HOME/runs, which is what is counted.
"""

import os
import signal
from pathlib import Path

import pytest
from prefect import flow

from flows.techniques import techniques
from trainflow.configs.mlp import MLPConfig
from trainflow.paths import trainflow_home
from trainflow.strategies import DDPConfig
from trainflow.strategies.job import Workload
from trainflow.workloads import mlp

pytestmark = pytest.mark.slow


def fail_in_user_code(config, strategy, **kwargs):
    raise ValueError("learning_rate schedule is broken (a bug in the training code)")


def rank1_killed_on_first_attempt(config, strategy, **kwargs):
    """Rank 1 is SIGKILLed (as by the OOM killer) in the first attempt only."""
    marker = Path(kwargs["output_dir"], "killed-once")
    if os.environ["RANK"] == "1" and not marker.exists():
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
    return mlp.train(config, strategy, **kwargs)


@flow
def train_once(workload: Workload, config: MLPConfig):
    return techniques["ddp"](workload=workload, technique=DDPConfig(), resources=config.resources)


def _workload(train_fn, tmp_path) -> tuple[Workload, MLPConfig]:
    config = MLPConfig(max_steps=4, gpu_type="cpu", retries=2, timeout_s=120)
    workload = Workload(
        train_fn=train_fn,
        model_fn=mlp.build_model,
        config=config,
        output_dir=str(tmp_path / "out"),
        resume_from=str(tmp_path / "out" / "checkpoints"),
    )
    return workload, config


def _launches() -> int:
    return len(list((trainflow_home() / "runs").iterdir()))


def test_an_error_in_user_code_is_not_retried(prefect_api, tmp_path):
    workload, config = _workload(fail_in_user_code, tmp_path)
    with pytest.raises(Exception, match="a bug in the training code"):
        train_once(workload, config)
    assert _launches() == 1


def test_a_killed_rank_is_retried_and_the_run_completes(prefect_api, tmp_path):
    workload, config = _workload(rank1_killed_on_first_attempt, tmp_path)
    result = train_once(workload, config)
    assert _launches() == 2
    assert result.steps == 4 and result.world_size == 2
