"""`python -m flows.transformer` end to end for each technique: real Prefect server, 2 gloo
ranks, a temporary MLflow store; and the technique subflows' checks before launch."""

import pytest
import torch

from flows import transformer as pipeline
from flows.techniques import techniques
from trainflow import tracking
from trainflow.models.mlp import SimpleMLP
from trainflow.paths import trainflow_home
from trainflow.strategies import STRATEGIES, FSDPConfig
from trainflow.strategies.job import Resources, Workload
from trainflow.workloads import mlp

TINY_ARGS = [
    *("--model-vocab-size", "64", "--model-seq-len", "16", "--model-d-model", "32"),
    *("--model-num-heads", "2", "--model-num-layers", "2", "--model-d-ff", "64"),
    *("--training-num-steps", "30", "--training-optimizer-learning-rate", "0.003"),
    *("--checkpoint-every", "15", "--gpu-type", "cpu"),
]


def build_mlp(config: mlp.MLPConfig) -> SimpleMLP:
    """A model without repeated blocks (importable, for `Workload.model_fn`)."""
    return SimpleMLP(config.num_features, config.hidden_size)


def test_every_strategy_has_a_subflow():
    assert set(techniques) == set(STRATEGIES)
    for name, subflow in techniques.items():
        assert subflow.name == name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("technique", "world_size"),
    [("fsdp", 2), ("ddp", 2), ('{"name": "deepspeed", "zero_stage": 3}', 2)],
    ids=["fsdp", "ddp", "deepspeed-zero3"],
)
def test_pipeline_registers_the_model_whichever_technique(prefect_api, technique, world_size):
    name = technique if technique.isalpha() else "deepspeed"
    model_name = f"transformer-{name}"
    args = [*TINY_ARGS, "--registered-model-name", model_name]
    result = pipeline.main(args if name == "fsdp" else [*args, "--technique", technique])
    assert result.technique == name and result.model_version == "1"
    assert result.checkpoint_uri.endswith("/checkpoints/step_000030")
    client = tracking.store_client()
    version = client.get_model_version(model_name, "1")
    assert version.tags["technique"] == name
    assert version.tags["world_size"] == str(world_size)
    assert version.tags["checkpoint_uri"] == result.checkpoint_uri
    run = client.get_run(version.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["technique"] == name
    assert run.data.params["technique.name"] == name
    assert run.data.metrics["eval_accuracy"] >= 0.5
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in history] == list(range(5, 31, 5))
    assert history[-1].value < history[0].value
    assert client.get_metric_history(run.info.run_id, "train_accuracy")
    import mlflow.pytorch

    model = mlflow.pytorch.load_model(f"models:/{model_name}/1")
    assert isinstance(model, torch.nn.Module)
    assert model(torch.zeros(3, 16, dtype=torch.long)).shape == (3, 4)


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (
            ["--technique", '{"name": "deepspeed", "zero_stage": 4}'],
            "--technique: deepspeed.zero_stage",
        ),
        (["--technique", "fsdp", "--gpus", "3"], "global_batch_size"),
        (["--technique", '{"name": "fsdp", "replicate_degree": 3}'], "replicate_degree"),
        (["--technique", "zero"], "--technique"),
    ],
)
def test_invalid_config_exits_before_any_rank_starts(capsys, args, option):
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main(args)
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err
    assert not (trainflow_home() / "runs").exists()


def test_fsdp_subflow_rejects_a_model_without_blocks_before_launch(prefect_api, tmp_path):
    workload = Workload(
        train_fn="trainflow.workloads.mlp:train",
        model_fn="tests.flows.test_transformer_flow:build_mlp",
        config=mlp.MLPConfig(),
        output_dir=str(tmp_path),
    )
    with pytest.raises(ValueError, match="technique fsdp: SimpleMLP has no repeated blocks"):
        techniques["fsdp"](workload=workload, technique=FSDPConfig(), resources=Resources())
    assert not (trainflow_home() / "runs").exists()
