"""Which framework can run which technique, checked before launch, and each strategy's settings
for the Hugging Face Trainer and its Lightning strategy object (built here, without ranks).

Real ranks training under both frameworks: tests/distributed/test_frameworks_ranks.py.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainflow.errors import FrameworkError
from trainflow.paths import trainflow_home
from trainflow.strategies import (
    DDPConfig,
    DeepSpeedConfig,
    FSDPConfig,
    OptimizerConfig,
    build_strategy,
)
from trainflow.strategies.config import FRAMEWORKS, check_framework
from trainflow.strategies.job import Resources, Workload, check_before_launch
from trainflow.workloads import transformer

REPO_ROOT = Path(__file__).resolve().parents[2]
BATCHES = {"micro_batch_size": 4, "grad_accum_steps": 2, "optimizer": OptimizerConfig()}

REFUSED = [
    (
        FSDPConfig(replicate_degree=2),
        "hf",
        None,
        "technique fsdp (replicate_degree=2) cannot run under the Hugging Face Trainer: "
        "accelerate's FSDP shards over all ranks; use replicate_degree=1",
    ),
    (
        FSDPConfig(cpu_offload=True),
        "lightning",
        None,
        "technique fsdp (cpu_offload=True) cannot run under the Lightning Trainer: "
        "Lightning's ModelParallelStrategy moves the sharded model to the GPU, which FSDP2's "
        "CPU offload forbids; use cpu_offload=false",
    ),
    (
        DeepSpeedConfig(zero_stage=3),
        "lightning",
        "cpu",
        "technique deepspeed (zero_stage=3) cannot run under the Lightning Trainer: "
        "Lightning's DeepSpeedStrategy runs on CUDA GPUs only, not on cpu",
    ),
    (
        DDPConfig(),
        "jax",
        None,
        "technique ddp cannot run under framework 'jax': unknown framework; known: torch, hf, "
        "lightning",
    ),
]


@pytest.mark.parametrize(
    ("technique", "framework", "device_type", "message"),
    REFUSED,
    ids=["hsdp-hf", "fsdp-offload-lightning", "deepspeed-lightning-cpu", "unknown-framework"],
)
def test_unsupported_pair_names_technique_and_framework(technique, framework, device_type, message):
    with pytest.raises(FrameworkError, match=f"^{re.escape(message)}$") as error:
        check_framework(technique, framework, device_type=device_type)
    assert isinstance(error.value, ValueError)


def test_each_technique_runs_under_exactly_its_frameworks(tmp_path):
    ds_file = tmp_path / "ds.json"
    ds_file.write_text('{"zero_optimization": {"stage": 2}}')
    everywhere = {"torch", "hf", "lightning"}
    expected = [
        (DDPConfig(find_unused_parameters=True), everywhere),
        (FSDPConfig(activation_checkpointing=True), everywhere),
        (FSDPConfig(replicate_degree=2), {"torch", "lightning"}),
        (FSDPConfig(cpu_offload=True, mixed_precision="bf16"), {"torch", "hf"}),
        (DeepSpeedConfig(zero_stage=3, offload_param=True), everywhere),
        (DeepSpeedConfig(config_file=str(ds_file)), everywhere),
    ]
    for technique, frameworks in expected:
        for device_type in ("cuda", None):
            runs = {
                f
                for f in FRAMEWORKS
                if technique.framework_problem(f, device_type=device_type) is None
            }
            assert runs == frameworks, technique.describe()
    # On CPU ranks Lightning's DeepSpeed is refused, nothing else.
    assert DeepSpeedConfig().framework_problem("lightning", device_type="cpu") is not None
    for technique in (DDPConfig(), FSDPConfig(), DeepSpeedConfig()):
        for framework in ("torch", "hf"):
            check_framework(technique, framework, device_type="cpu")
    check_framework(FSDPConfig(), "lightning", device_type="cpu")


def test_unsupported_pair_fails_before_any_rank_starts(tmp_path):
    config = transformer.TransformerConfig()
    workload = Workload(
        train_fn="trainflow.workloads.transformer:train",
        model_fn="trainflow.workloads.transformer:build_model",
        config=config,
        output_dir=str(tmp_path),
        framework="hf",
    )
    with pytest.raises(FrameworkError, match=r"technique fsdp \(replicate_degree=2\) .* Hugging"):
        check_before_launch(workload, FSDPConfig(replicate_degree=2), Resources(gpus=2))
    assert not (trainflow_home() / "runs").exists()


def test_framework_check_runs_without_torch():
    code = (
        "import sys\n"
        "from trainflow.strategies.config import FSDPConfig, check_framework\n"
        "try:\n"
        "    check_framework(FSDPConfig(replicate_degree=2), 'hf')\n"
        "except ValueError as e:\n"
        "    print(type(e).__name__)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    )
    assert out.stdout.split() == ["FrameworkError", "False"]


@pytest.mark.parametrize(
    ("technique", "framework"),
    [(FSDPConfig(replicate_degree=2), "hf"), (FSDPConfig(cpu_offload=True), "lightning")],
)
def test_strategy_refuses_with_the_pre_launch_message(technique, framework):
    with pytest.raises(FrameworkError) as expected:
        check_framework(technique, framework)
    strategy = build_strategy(technique)
    with pytest.raises(FrameworkError) as got:
        if framework == "hf":
            strategy.hf_trainer_args(**BATCHES, layer_classes=["Block"])
        else:
            strategy.lightning_strategy(**BATCHES)
    assert str(got.value) == str(expected.value)


@pytest.fixture
def two_ranks(monkeypatch):
    """The environment of rank 1 of 2; the FSDP_* variables `hf_trainer_args` sets are restored."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TRAINFLOW_DEVICE", "cpu")
    for name in ("FSDP_VERSION", "FSDP_RESHARD_AFTER_FORWARD", "FSDP_STATE_DICT_TYPE"):
        monkeypatch.setenv(name, "unset")


def test_hf_trainer_args_for_ddp(two_ranks):
    args = build_strategy(DDPConfig(bucket_cap_mb=10.4, find_unused_parameters=True))
    assert args.hf_trainer_args(**BATCHES, layer_classes=["Block"]) == {
        "use_cpu": True,
        "ddp_backend": "gloo",
        "ddp_bucket_cap_mb": 10,
        "ddp_find_unused_parameters": True,
    }


def test_hf_trainer_args_for_fsdp_on_gpu(two_ranks):
    import os

    technique = FSDPConfig(reshard_after_forward=False, cpu_offload=True, mixed_precision="bf16")
    args = build_strategy(technique).hf_trainer_args(
        **BATCHES, layer_classes=["LlamaDecoderLayer"], device_type="cuda"
    )
    assert args == {
        "use_cpu": False,
        "ddp_backend": "nccl",
        "fsdp": "full_shard auto_wrap offload",
        "fsdp_config": {
            "version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "activation_checkpointing": False,
            "reshard_after_forward": False,
            "state_dict_type": "SHARDED_STATE_DICT",
        },
        "bf16": True,
    }
    assert (
        os.environ["FSDP_VERSION"],
        os.environ["FSDP_RESHARD_AFTER_FORWARD"],
        os.environ["FSDP_STATE_DICT_TYPE"],
    ) == ("2", "false", "SHARDED_STATE_DICT")


def test_hf_trainer_args_for_deepspeed_on_gpu(two_ranks):
    args = build_strategy(DeepSpeedConfig(zero_stage=3)).hf_trainer_args(
        **BATCHES, layer_classes=[], device_type="cuda"
    )
    assert sorted(args) == ["bf16", "ddp_backend", "deepspeed", "use_cpu"]
    assert args["bf16"] is False and args["use_cpu"] is False
    ds = args["deepspeed"]
    assert ds["zero_optimization"]["stage"] == 3
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (4, 2)
    assert ds["train_batch_size"] == 4 * 2 * 2
    assert ds["optimizer"]["params"]["torch_adam"] is False  # fused Adam on GPUs
    # Without it the Trainer casts float inputs to fp16.
    assert ds["fp16"] == {"enabled": False}


def test_hf_trainer_args_for_deepspeed_on_cpu_disable_compiled_ops(two_ranks, monkeypatch):
    import deepspeed

    monkeypatch.setattr(deepspeed.ops, "__compatible_ops__", {"cpu_adam": True})
    args = build_strategy(DeepSpeedConfig()).hf_trainer_args(**BATCHES, layer_classes=[])
    assert args["use_cpu"] is True and args["ddp_backend"] == "gloo"
    assert args["deepspeed"]["optimizer"]["params"]["torch_adam"] is True
    assert deepspeed.ops.__compatible_ops__ == {}


def test_single_rank_gets_no_process_group_backend(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TRAINFLOW_DEVICE", "cpu")
    args = build_strategy(DDPConfig()).hf_trainer_args(**BATCHES, layer_classes=[])
    assert "ddp_backend" not in args and args["use_cpu"] is True


@pytest.fixture
def torchelastic_rank_1(monkeypatch):
    """What torch elastic gives rank 1 of 2 on one node (no process group: nothing connects)."""
    env = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "test",
        "TRAINFLOW_DEVICE": "cpu",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.slow  # importing Lightning takes ~5 s
@pytest.mark.parametrize(
    ("technique", "expected"),
    [(DDPConfig(bucket_cap_mb=2), "DDPStrategy"), (FSDPConfig(), "ModelParallelStrategy")],
    ids=["ddp", "fsdp"],
)
def test_lightning_trainer_takes_the_launched_rank(torchelastic_rank_1, technique, expected):
    import lightning as L
    from lightning.pytorch import strategies

    strategy = build_strategy(technique).lightning_strategy(**BATCHES)
    assert type(strategy) is getattr(strategies, expected)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert trainer.strategy is strategy
    assert (trainer.global_rank, trainer.world_size, trainer.num_devices) == (1, 2, 2)
    assert strategy.cluster_environment.creates_processes_externally


@pytest.mark.slow  # importing Lightning takes ~5 s
def test_lightning_deepspeed_strategy_on_mock_gpu(torchelastic_rank_1, monkeypatch):
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision
    from lightning.pytorch.strategies import DeepSpeedStrategy

    monkeypatch.setenv("TRAINFLOW_DEVICE", "cuda")  # a device name; no GPU is touched
    technique = DeepSpeedConfig(zero_stage=3, mixed_precision="bf16")
    strategy = build_strategy(technique).lightning_strategy(**BATCHES)
    assert type(strategy) is DeepSpeedStrategy
    assert isinstance(strategy.precision_plugin, DeepSpeedPrecision)
    assert strategy.precision_plugin.precision == "bf16-mixed"
    # Lightning refuses this key (it sets it from accumulate_grad_batches).
    assert "gradient_accumulation_steps" not in strategy.config
    assert strategy.config["zero_optimization"]["stage"] == 3
