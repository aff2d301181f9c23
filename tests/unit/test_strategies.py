"""Technique configs, DeepSpeed's JSON, block discovery, the loop's cadence, checkpoints.

Every invalid config here fails while it is parsed or checked in the caller: no process starts.
"""

import json
import os

import pytest
from pydantic import ValidationError

from trainflow import checkpoint
from trainflow.models.mlp import SimpleMLP
from trainflow.paths import trainflow_home
from trainflow.strategies import (
    STRATEGIES,
    DDPConfig,
    DeepSpeedConfig,
    FSDPConfig,
    OptimizerConfig,
    TechniqueConfig,
    deepspeed_json,
    find_blocks,
)
from trainflow.strategies.job import Resources, Workload, check_before_launch
from trainflow.strategies.loop import Schedule
from trainflow.workloads import mlp
from trainflow.workloads.transformer import TransformerConfig, build_model

TINY = {"vocab_size": 64, "seq_len": 8, "d_model": 32, "num_heads": 2, "num_layers": 2, "d_ff": 64}


def build_mlp(config: mlp.MLPConfig) -> SimpleMLP:
    """A model without repeated blocks (importable, for `Workload.model_fn`)."""
    return SimpleMLP(config.num_features, config.hidden_size)


def test_technique_is_chosen_by_name():
    from trainflow.strategies.technique import TECHNIQUES

    # What `TechniqueConfig` held when this module was imported; other test modules may have
    # registered techniques of their own since (test_toy_technique).
    names = {c.model_fields["name"].default for c in TechniqueConfig.__args__[0].__args__}
    assert {"ddp", "fsdp", "deepspeed"} <= names <= set(STRATEGIES) == set(TECHNIQUES)
    field = TransformerConfig.model_fields["technique"]
    members = {c.model_fields["name"].default for c in field.annotation.__args__}
    assert members == set(TECHNIQUES)  # the pipelines' configs take every registered one
    assert isinstance(TransformerConfig().technique, FSDPConfig)
    config = TransformerConfig(technique={"name": "deepspeed", "zero_stage": 3})
    assert isinstance(config.technique, DeepSpeedConfig) and config.technique.zero_stage == 3
    assert isinstance(TransformerConfig(technique={"name": "ddp"}).technique, DDPConfig)


@pytest.mark.parametrize(
    ("technique", "field"),
    [
        ({"name": "deepspeed", "zero_stage": 4}, "zero_stage"),
        ({"name": "deepspeed", "zero_stage": 0}, "zero_stage"),
        ({"name": "deepspeed", "zero_stage": 2, "offload_param": True}, "offload_param"),
        ({"name": "deepspeed", "config_file": "/nonexistent/ds.json"}, "config_file"),
        ({"name": "fsdp", "replicate_degree": 3}, "replicate_degree"),
        ({"name": "fsdp", "reshard_after_forwards": True}, "reshard_after_forwards"),
        ({"name": "zero"}, "name"),
    ],
)
def test_invalid_technique_names_the_field(technique, field):
    with pytest.raises(ValidationError, match=field):
        TransformerConfig(technique=technique, gpus=2)


def test_world_size_must_split_into_replica_groups():
    TransformerConfig(technique={"name": "fsdp", "replicate_degree": 2}, gpus=4)
    with pytest.raises(ValidationError, match=r"replicate_degree=4 does not divide .* 6"):
        TransformerConfig(
            technique={"name": "fsdp", "replicate_degree": 4},
            gpus=6,
            training={"global_batch_size": 12},
        )


def test_batch_and_model_shape_are_checked():
    with pytest.raises(ValidationError, match="training.global_batch_size=10"):
        TransformerConfig(training={"global_batch_size": 10, "grad_accum_steps": 2})
    with pytest.raises(ValidationError, match="model.num_heads=3"):
        TransformerConfig(model={"num_heads": 3})


def test_config_file_excludes_typed_options(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    DeepSpeedConfig(config_file=str(path))
    with pytest.raises(ValidationError, match="config_file replaces the typed options.*zero_stage"):
        DeepSpeedConfig(config_file=str(path), zero_stage=3)
    path.write_text("[1, 2]")
    with pytest.raises(ValidationError, match="config_file .* must hold a JSON object"):
        DeepSpeedConfig(config_file=str(path))


def test_deepspeed_json_from_typed_config():
    config = DeepSpeedConfig(zero_stage=3, offload_optimizer=True, offload_param=True)
    ds = deepspeed_json(
        config,
        micro_batch_size=4,
        grad_accum_steps=2,
        world_size=2,
        optimizer=OptimizerConfig(learning_rate=0.01, weight_decay=0.1),
        device_type="cpu",
    )
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["optimizer"]["type"] == "AdamW"
    assert (
        ds["optimizer"]["params"] | {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}
        == (ds["optimizer"]["params"])
    )
    assert ds["zero_force_ds_cpu_optimizer"] is False and ds["bf16"] == {"enabled": False}


def test_deepspeed_json_on_gpu_uses_fused_adam_and_bf16():
    # A parameter, not a device: this builds the JSON a GPU rank would get.
    ds = deepspeed_json(
        DeepSpeedConfig(zero_stage=2, mixed_precision="bf16"),
        micro_batch_size=8,
        grad_accum_steps=1,
        world_size=8,
        optimizer=OptimizerConfig(),
        device_type="cuda",
    )
    assert ds["optimizer"]["params"]["torch_adam"] is False
    assert ds["bf16"] == {"enabled": True} and ds["zero_force_ds_cpu_optimizer"] is True


def test_deepspeed_user_file_is_completed_not_overridden(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000},
                "gradient_clipping": 1.0,
            }
        )
    )
    kwargs = {"grad_accum_steps": 1, "world_size": 2, "optimizer": OptimizerConfig()}
    ds = deepspeed_json(
        DeepSpeedConfig(config_file=str(path)), micro_batch_size=4, device_type="cpu", **kwargs
    )
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["train_batch_size"] == 8
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1000
    assert ds["gradient_clipping"] == 1.0 and ds["optimizer"]["params"]["torch_adam"] is True
    path.write_text(json.dumps({"train_batch_size": 64}))
    with pytest.raises(ValueError, match="config_file sets train_batch_size=64 .* needs 8"):
        deepspeed_json(
            DeepSpeedConfig(config_file=str(path)), micro_batch_size=4, device_type="cpu", **kwargs
        )


def test_blocks_are_the_repeated_layers():
    config = TransformerConfig(model=TINY | {"num_layers": 3})
    model = build_model(config)
    assert find_blocks(model) == list(model.blocks)
    assert find_blocks(SimpleMLP()) == []


def test_fsdp_on_a_model_without_blocks_fails_before_launch(tmp_path):
    workload = Workload(
        train_fn="trainflow.workloads.mlp:train",
        model_fn="tests.unit.test_strategies:build_mlp",
        config=mlp.MLPConfig(),
        output_dir=str(tmp_path),
    )
    with pytest.raises(ValueError, match="technique fsdp: SimpleMLP has no repeated blocks"):
        check_before_launch(workload, FSDPConfig(), Resources(gpus=2))
    check_before_launch(workload, DDPConfig(), Resources(gpus=2))
    assert not (trainflow_home() / "runs").exists()


def test_schedule_logs_and_checkpoints_at_cadence_and_end():
    schedule = Schedule(num_steps=10, log_every=4, checkpoint_every=3)
    assert [s for s in range(1, 11) if schedule.should_log(s)] == [4, 8, 10]
    assert [s for s in range(1, 11) if schedule.should_checkpoint(s)] == [3, 6, 9, 10]
    never = Schedule(num_steps=10, log_every=1, checkpoint_every=0)
    assert not any(never.should_checkpoint(s) for s in range(1, 11))


def test_resume_picks_the_latest_complete_checkpoint(tmp_path):
    assert checkpoint.resolve(None) is None
    assert checkpoint.resolve(tmp_path) is None
    for step in (2, 4, 10):
        checkpoint.checkpoint_path(tmp_path, step).mkdir()
    for step in (2, 4):
        checkpoint.mark_complete(checkpoint.checkpoint_path(tmp_path, step), step)
    latest = checkpoint.resolve(tmp_path)  # step 10 was never completed
    assert latest == tmp_path / "step_000004"
    assert checkpoint.resolve(latest) == latest
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checkpoint.read_meta(tmp_path / "step_000010")


def test_workload_functions_are_imported_when_called_and_travel_by_path():
    import pickle

    import cloudpickle

    workload = Workload(
        train_fn="trainflow.workloads.mlp:train",
        model_fn="tests.unit.test_strategies.build_mlp",  # pydantic's dotted form works too
        config=mlp.MLPConfig(),
        output_dir="out",
    )
    assert workload.model_dump(mode="json")["model_fn"] == "tests.unit.test_strategies:build_mlp"
    assert isinstance(workload.model_fn(mlp.MLPConfig()), SimpleMLP)
    assert workload.train_fn.resolve() is mlp.train
    copy = pickle.loads(pickle.dumps(workload))
    assert copy == workload and copy.train_fn.resolve() is mlp.train

    def local_model(config):  # not importable: travels as itself
        return build_mlp(config)

    given = Workload(
        train_fn=mlp.train, model_fn=local_model, config=mlp.MLPConfig(), output_dir="o"
    )
    assert given.train_fn.path == "trainflow.workloads.mlp:train"
    moved = cloudpickle.loads(cloudpickle.dumps(given))
    assert isinstance(moved.model_fn(mlp.MLPConfig()), SimpleMLP)
    with pytest.raises(ValidationError, match="module:function"):
        Workload(train_fn="train", model_fn=build_mlp, config=mlp.MLPConfig(), output_dir="o")


def test_a_workload_checked_ahead_is_not_built_again_before_launch(tmp_path):
    def must_not_build(config):
        raise AssertionError("built again")

    workload = Workload(
        train_fn=mlp.train,
        model_fn=must_not_build,
        config=mlp.MLPConfig(),
        output_dir=str(tmp_path),
        checked_ahead=True,
    )
    check_before_launch(workload, DDPConfig(), Resources(gpus=2, gpu_type="cpu"))
    with pytest.raises(AssertionError, match="built again"):
        check_before_launch(
            workload.model_copy(update={"checked_ahead": False}),
            DDPConfig(),
            Resources(gpus=2, gpu_type="cpu"),
        )


@pytest.mark.parametrize(
    ("listed", "readable"),
    [
        ("8.0;9.0a", "8.0;9.0"),
        ("9.0a+PTX 10.0f", "9.0+PTX;10.0"),
        ("8.0 8.6 9.0", "8.0;8.6;9.0"),
        ("9.0;9.0a", "9.0"),
    ],
)
def test_arch_specific_targets_become_ones_deepspeed_reads(listed, readable):
    from trainflow.strategies.deepspeed import readable_arch_list

    assert readable_arch_list(listed) == readable


def test_deepspeed_builds_its_fused_adam_flags_from_an_image_arch_list(monkeypatch):
    """DeepSpeed's own CUDA op builder, which reads the list without touching a GPU: it fails
    on a CUDA image's `9.0a` as it is, and takes the list `prepare_compiled_ops` leaves."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    from trainflow.strategies.deepspeed import prepare_compiled_ops

    builder = FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    with pytest.raises(ValueError, match="0a"):
        builder.compute_capability_args()
    prepare_compiled_ops("cuda")
    builder.compute_capability_args()
    assert builder.enable_bf16
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"
