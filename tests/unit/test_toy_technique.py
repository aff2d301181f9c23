"""A technique added from outside the library, in this module only.

`toy_ddp` is DDP with 1 MiB gradient buckets under a name of its own. One call registers it;
from then on the command line, the Prefect form and the technique subflows offer it, our loop
runs it on 2 gloo ranks (which import this module to unpickle its config, and so register it
too), the Hugging Face Trainer gets its settings and the memory plan estimates it. Nothing in
trainflow/, flows/ or tasks/ names it.
"""

import json
from typing import Any, Literal

import pytest
from prefect.utilities.callables import parameter_schema
from pydantic import Field

from flows.techniques import techniques
from trainflow.cli import build_parser, parse_config
from trainflow.configs.sft import SFTConfig
from trainflow.configs.transformer import TransformerConfig
from trainflow.memory import KNOWN_MODELS, estimate, plan_sft
from trainflow.strategies import (
    DDPConfig,
    OptimizerConfig,
    Strategy,
    build_strategy,
    register_technique,
)
from trainflow.strategies.ddp import DDPStrategy
from trainflow.strategies.job import TrainResult, Workload
from trainflow.workloads import transformer


class ToyConfig(DDPConfig):
    """DDP with small gradient buckets, a technique defined outside the library."""

    name: Literal["toy_ddp"] = Field(default="toy_ddp", description="Technique name.")
    bucket_cap_mb: float = Field(
        default=1.0, gt=0, description="Gradient bucket size in MiB for the all-reduce."
    )


class ToyStrategy(DDPStrategy):
    """DDP's strategy under the toy's name (checkpoints and results say `toy_ddp`)."""

    name = "toy_ddp"


register_technique(ToyConfig, "tests.unit.test_toy_technique:ToyStrategy")

TINY = {"vocab_size": 64, "seq_len": 8, "d_model": 32, "num_heads": 2, "num_layers": 2, "d_ff": 64}
LLAMA_1B = "meta-llama/Llama-3.2-1B-Instruct"


def _parse(argv: list[str]) -> TransformerConfig:
    return parse_config(TransformerConfig, TransformerConfig(), argv, "transformer", "")


def _variants(schema: dict[str, Any], field: str) -> set[str]:
    """The discriminator's names of a union field in a JSON schema (the Prefect form)."""
    union = schema["properties"][field]
    return set(union["discriminator"]["mapping"])


def test_the_command_line_offers_it_and_validates_its_options(capsys):
    help_text = " ".join(
        build_parser(TransformerConfig, TransformerConfig(), "t", "").format_help().split()
    )
    assert "One of: ddp, fsdp, deepspeed, toy_ddp;" in help_text

    by_name = _parse(["--technique", "toy_ddp"]).technique
    assert type(by_name) is ToyConfig and by_name.bucket_cap_mb == 1.0
    as_json = _parse(["--technique", json.dumps({"name": "toy_ddp", "bucket_cap_mb": 4})])
    assert type(as_json.technique) is ToyConfig and as_json.technique.bucket_cap_mb == 4

    with pytest.raises(SystemExit):
        _parse(["--technique", json.dumps({"name": "toy_ddp", "bucket_cap_mb": 0})])
    assert "bucket_cap_mb" in capsys.readouterr().err


def test_pipeline_forms_and_the_technique_subflow_show_it():
    assert {"ddp", "fsdp", "deepspeed", "toy_ddp"} <= _variants(
        TransformerConfig.model_json_schema(), "technique"
    )
    assert "toy_ddp" in _variants(SFTConfig.model_json_schema(), "technique")
    assert type(SFTConfig(technique="toy_ddp").technique) is ToyConfig

    subflow = techniques["toy_ddp"]
    assert subflow.name == "toy_ddp" and "toy_ddp" in set(techniques)
    form = parameter_schema(subflow.fn).model_dump()
    toy = form["definitions"]["ToyConfig"]["properties"]
    assert toy["name"]["default"] == "toy_ddp" and toy["bucket_cap_mb"]["default"] == 1.0


def test_the_hugging_face_trainer_gets_its_bucket_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TRAINFLOW_DEVICE", "cpu")
    strategy = build_strategy(ToyConfig(bucket_cap_mb=3.4))
    assert type(strategy) is ToyStrategy
    batches = {"micro_batch_size": 4, "grad_accum_steps": 2, "optimizer": OptimizerConfig()}
    assert strategy.hf_trainer_args(**batches, layer_classes=["Block"]) == {
        "use_cpu": True,
        "ddp_backend": "gloo",
        "ddp_bucket_cap_mb": 3,
        "ddp_find_unused_parameters": False,
    }


def test_the_memory_plan_estimates_it():
    config = SFTConfig(model=LLAMA_1B, technique="toy_ddp", gpus=8, gpu_type="H100")
    plan = plan_sft(config, detect=False)
    assert plan.requested == "toy_ddp" and type(plan.technique) is ToyConfig and plan.checked
    assert plan.estimate.technique == "toy_ddp" and plan.lines()[-1].endswith(": fits")

    ddp = estimate(KNOWN_MODELS[LLAMA_1B], config.training_setup(), DDPConfig())
    assert plan.estimate.parts() == ddp.parts()  # DDP's formula, inherited


def train_reporting_buckets(
    config: TransformerConfig, strategy: Strategy, **run: Any
) -> TrainResult:
    """The transformer workload's own loop; the result adds the bucket size DDP was built with."""
    result = transformer.train(config, strategy, **run)
    bucket_mb = strategy.wrapped.bucket_bytes_cap / 2**20
    return result.model_copy(update={"metrics": result.metrics | {"bucket_cap_mb": bucket_mb}})


@pytest.mark.slow
def test_our_loop_runs_it_on_two_gloo_ranks_through_its_subflow(prefect_api, tmp_path):
    config = TransformerConfig(
        model=TINY,
        training={"num_steps": 4, "global_batch_size": 8, "log_every": 1},
        technique={"name": "toy_ddp"},
        gpus=2,
        gpu_type="cpu",
        timeout_s=300,
    )
    workload = Workload(
        train_fn="tests.unit.test_toy_technique:train_reporting_buckets",
        model_fn="trainflow.workloads.transformer:build_model",
        config=config,
        output_dir=str(tmp_path),
    )
    result = techniques["toy_ddp"](
        workload=workload, technique=config.technique, resources=config.resources
    )
    assert (result.technique, result.world_size, result.steps) == ("toy_ddp", 2, 4)
    assert result.wrapped_as == "DistributedDataParallel"
    assert result.metrics["bucket_cap_mb"] == 1.0  # the toy's default, not DDP's 25
