"""SFT config, presets, command line, technique -> Trainer settings, evaluation helpers."""

import os

import pytest
import torch
from pydantic import ValidationError

from flows import sft as pipeline
from trainflow.data.tokenizer import load_tokenizer
from trainflow.evaluation import split_prompt_answer
from trainflow.models.causal_lm import TINY_ARCHITECTURES, build_causal_lm
from trainflow.strategies import DDPConfig, DeepSpeedConfig, FSDPConfig
from trainflow.workloads import sft


def _parse(argv: list[str]) -> sft.SFTConfig:
    return pipeline.parse_args(argv)


def test_debug_preset_is_tiny_llama_on_shipped_data_with_ddp_on_2_cpu_ranks():
    config = sft.load_sft_preset("debug_cpu")
    assert (config.model, config.dataset, config.technique.name) == (
        "tiny-llama",
        "instructions",
        "ddp",
    )
    assert (config.gpus, config.gpu_type, config.registered_model_name) == (2, "cpu", "sft")
    data = config.data_config()
    assert data.transform.tokenizer == sft.SHIPPED_TOKENIZER
    assert data.transform.max_length == config.max_length and data.validation is not None


def test_h100_preset_is_the_hub_example_with_deepspeed():
    config = sft.load_sft_preset("h100")
    assert config.model == "meta-llama/Llama-3.2-1B-Instruct" and config.gpus == 8
    assert isinstance(config.technique, DeepSpeedConfig)
    data = config.data_config()
    assert data.source.kind == "hub" and data.source.name == "trl-lib/Capybara"
    assert data.transform.tokenizer == config.model and data.name == "trl-lib--Capybara"


def test_command_line_overrides_the_issue_options():
    config = _parse(
        ["--technique", "fsdp", "--gpus", "4", "--max-steps", "7", "--model", "tiny-gpt-oss"]
        + ["--dataset", "org/chat", "--lora", "--registered-model-name", "mine"]
    )
    assert isinstance(config.technique, FSDPConfig)
    assert (config.gpus, config.max_steps, config.model, config.dataset) == (
        4,
        7,
        "tiny-gpt-oss",
        "org/chat",
    )
    assert config.lora and config.registered_model_name == "mine"
    assert not _parse(["--no-lora"]).lora
    assert _parse(["--preset", "h100", "--max-steps", "3"]).max_steps == 3
    zero3 = _parse(["--technique", '{"name": "deepspeed", "zero_stage": 3}', "--gpus", "2"])
    assert isinstance(zero3.technique, DeepSpeedConfig) and zero3.technique.zero_stage == 3


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"dataset": "nope"}, "dataset"),
        ({"technique": {"name": "fsdp", "replicate_degree": 2}}, "replicate_degree"),
        ({"registered_model_name": "../x"}, "registered_model_name"),
        ({"max_steps": 0}, "max_steps"),
    ],
)
def test_bad_config_fails_before_any_rank_naming_the_field(update, field):
    raw = sft.load_sft_preset("debug_cpu").model_dump() | update
    with pytest.raises(ValidationError, match=field):
        sft.SFTConfig.model_validate(raw)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="debug_cpu"):
        sft.load_sft_preset("missing")


def test_techniques_become_trainer_settings(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    training = sft.TrainingSettings(per_device_batch_size=4, grad_accum_steps=2)
    ddp = sft.technique_arguments(
        DDPConfig(bucket_cap_mb=10), training, device_type="cpu", layer_classes=["Block"]
    )
    assert ddp == {
        "use_cpu": True,
        "ddp_backend": "gloo",
        "ddp_bucket_cap_mb": 10,
        "ddp_find_unused_parameters": False,
    }
    fsdp = sft.technique_arguments(
        FSDPConfig(reshard_after_forward=False, activation_checkpointing=True),
        training,
        device_type="cuda",
        layer_classes=["LlamaDecoderLayer"],
    )
    assert fsdp["fsdp"] == "full_shard auto_wrap" and fsdp["ddp_backend"] == "nccl"
    assert fsdp["fsdp_config"]["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    assert fsdp["fsdp_config"]["activation_checkpointing"] is True
    assert os.environ["FSDP_VERSION"] == "2" and os.environ["FSDP_RESHARD_AFTER_FORWARD"] == "false"
    ds = sft.technique_arguments(
        DeepSpeedConfig(zero_stage=3), training, device_type="cuda", layer_classes=[]
    )["deepspeed"]
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["train_batch_size"] == 4 * 2 * 2
    assert ds["optimizer"]["params"]["lr"] == training.optimizer.learning_rate


def test_prompt_is_before_the_first_answer_and_the_answer_is_its_first_run():
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    mask = [0, 0, 1, 1, 0, 0, 1, 0]
    assert split_prompt_answer(ids, mask) == ([1, 2], [3, 4])


def test_gate_names_each_unmet_threshold():
    settings = sft.EvaluationSettings(min_exact_match=0.5, max_loss_ratio=0.8)
    good = {"eval_exact_match": 0.6, "eval_loss_ratio": 0.5}
    assert sft.gate_failures(settings, good) == []
    bad = sft.gate_failures(settings, {"eval_exact_match": 0.1, "eval_loss_ratio": 0.9})
    assert len(bad) == 2 and "min_exact_match" in bad[0] and "max_loss_ratio" in bad[1]


@pytest.mark.parametrize("name", sorted(TINY_ARCHITECTURES))
def test_tiny_architectures_build_offline_with_the_shipped_vocabulary(name):
    tokenizer = load_tokenizer(sft.SHIPPED_TOKENIZER)
    model = build_causal_lm(name, tokenizer, seed=0)
    assert model.config.vocab_size == len(tokenizer)
    ids = torch.tensor([[tokenizer.bos_token_id, 5, 6, 7]])
    assert model(input_ids=ids).logits.shape == (1, 4, len(tokenizer))
    if name == "tiny-gpt-oss":
        assert model.config.num_local_experts == 4 and model.config.num_experts_per_tok == 2
    again = build_causal_lm(name, tokenizer, seed=0)
    assert torch.equal(model.lm_head.weight, again.lm_head.weight)  # seeded: same baseline


def test_unknown_preset_on_the_command_line_names_the_choices(capsys):
    with pytest.raises(SystemExit):
        _parse(["--preset", "nope"])
    err = capsys.readouterr().err
    assert "--preset: invalid choice: 'nope'" in err and "debug_cpu" in err
