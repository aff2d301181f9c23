"""The GPU paths: nccl, device binding, bf16 mixed precision, DeepSpeed's fused Adam.

Real GPUs only (no mocks); skipped where CUDA is absent. Each uses up to 2 GPUs.
"""

import pytest
import torch

from tests.distributed.test_strategies import losses, reference, run, tiny_config
from trainflow.strategies import DDPConfig, DeepSpeedConfig, FSDPConfig
from trainflow.strategies.job import local_path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BF16_RTOL = 5e-2


def gpu_config(technique):
    config = tiny_config(technique, checkpoint_every=3)
    gpus = min(2, torch.cuda.device_count())
    return config.model_copy(update={"gpus": gpus, "gpu_type": None})


def assert_trains_like_reference(result, config, rtol):
    expected, _ = reference(config)
    for step, loss in losses(result).items():
        assert loss == pytest.approx(expected[step], rel=rtol), f"step {step}"
    state = torch.load(local_path(result.model_uri), map_location="cpu", weights_only=True)
    assert all(v.device.type == "cpu" for v in state.values())


def test_ddp_on_gpus_with_nccl_matches_single_process(tmp_path):
    config = gpu_config(DDPConfig())
    result = run(config, tmp_path)[0]
    assert result.world_size == config.resources.gpus
    assert_trains_like_reference(result, config, rtol=1e-3)


def test_fsdp_bf16_on_gpus(tmp_path):
    config = gpu_config(FSDPConfig(mixed_precision="bf16"))
    result = run(config, tmp_path)[0]
    assert_trains_like_reference(result, config, rtol=BF16_RTOL)
    state = torch.load(local_path(result.model_uri), weights_only=True)
    assert {v.dtype for v in state.values()} == {torch.float32}  # fp32 master weights


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_bf16_with_fused_adam_on_gpus(tmp_path, stage):
    config = gpu_config(DeepSpeedConfig(zero_stage=stage, mixed_precision="bf16"))
    result = run(config, tmp_path)[0]
    assert result.technique == "deepspeed" and result.steps == 6
    assert_trains_like_reference(result, config, rtol=BF16_RTOL)
