"""SFT config, presets, command line, technique -> Trainer settings, evaluation helpers."""

import os

import pytest
import torch
from pydantic import ValidationError

from flows import command
from trainflow.data.tokenizer import load_tokenizer
from trainflow.evaluation import split_prompt_answer
from trainflow.models.causal_lm import TINY_ARCHITECTURES, build_causal_lm
from trainflow.strategies import DDPConfig, DeepSpeedConfig, FSDPConfig
from trainflow.workloads import sft


def _parse(argv: list[str]) -> sft.SFTConfig:
    return command.parse_args("sft", argv)


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


GPU_PRESETS = {
    "gpt-oss-20b": ("openai/gpt-oss-20b", "ddp", True),
    "gpt-oss-120b": ("openai/gpt-oss-120b", "fsdp", True),
    "llama-3.2-1b-zero3": ("meta-llama/Llama-3.2-1B-Instruct", "deepspeed", False),
}


def test_gpu_presets_load_and_are_listed_by_help(capsys):
    for name, (model, technique, lora) in GPU_PRESETS.items():
        config = sft.load_sft_preset(name)
        assert (config.model, config.technique.name, config.lora) == (model, technique, lora)
        assert (config.gpus, config.gpu_type, config.compute_precision()) == (8, "H100", "bf16")
        assert config.data_config().source.kind == "hub"
    oss = sft.load_sft_preset("gpt-oss-120b")
    assert isinstance(oss.technique, FSDPConfig) and oss.technique.activation_checkpointing
    assert oss.technique.reshard_after_forward and oss.cpu_ram_efficient_loading
    assert oss.weights_dtype() == "bf16"  # the frozen base
    assert sft.load_sft_preset("llama-3.2-1b-zero3").technique.zero_stage == 3
    assert sft.load_sft_preset("gpt-oss-20b").weights_dtype() == "bf16"
    with pytest.raises(SystemExit):
        _parse(["--help"])
    help_text = capsys.readouterr().out
    assert all(name in help_text for name in GPU_PRESETS)
    assert "One of: ddp, fsdp, deepspeed, auto" in " ".join(help_text.split())


def test_precision_goes_into_a_technique_that_does_not_set_its_own():
    fsdp = _parse(["--preset", "gpt-oss-20b", "--technique", "fsdp"])
    assert fsdp.technique.mixed_precision == "bf16" and fsdp.weights_dtype() == "bf16"
    assert fsdp.technique.activation_checkpointing  # gradient checkpointing, FSDP's way
    assert _parse(["--technique", "deepspeed", "--precision", "bf16"]).technique.mixed_precision
    assert _parse(["--precision", "bf16"]).weights_dtype() == "fp32"  # DDP autocasts fp32
    assert _parse([]).compute_precision() == "fp32"
    raw = sft.load_sft_preset("h100").model_dump() | {"precision": "fp32"}
    with pytest.raises(ValidationError, match="technique.mixed_precision='bf16'"):
        sft.SFTConfig.model_validate(raw)
    off = {"name": "fsdp", "activation_checkpointing": False}
    raw = sft.load_sft_preset("debug_cpu").model_dump() | {"technique": off}
    with pytest.raises(ValidationError, match="same option"):
        sft.SFTConfig.model_validate(raw | {"gradient_checkpointing": True})


def test_technique_auto_by_name_in_a_config_or_on_the_command_line(tmp_path):
    path = tmp_path / "auto.yaml"
    path.write_text("technique: auto\ngpus: 2\ngpu_type: cpu\n")
    assert _parse(["--config", str(path)]).technique.name == "auto"
    config = _parse(["--technique", "auto", "--gpu-memory-gb", "80"])
    assert config.technique.name == "auto" and config.gpu_memory_gb == 80.0
    resolved = config.with_technique(FSDPConfig())
    assert isinstance(resolved.technique, FSDPConfig) and resolved.gpu_memory_gb == 80.0


@pytest.mark.parametrize("name", sorted(GPU_PRESETS))
def test_tiny_twin_keeps_the_recipe_and_swaps_model_data_and_ranks(name):
    preset = sft.load_sft_preset(name)
    twin = sft.tiny_twin(preset, max_steps=5)
    assert twin.model == ("tiny-gpt-oss" if "gpt-oss" in name else "tiny-llama")
    assert (twin.dataset, twin.tokenizer_path(), twin.max_length) == (
        "instructions",
        sft.SHIPPED_TOKENIZER,
        64,
    )
    assert (twin.gpus, twin.gpu_type, twin.nnodes, twin.max_steps) == (2, "cpu", 1, 5)
    assert twin.compute_precision() == "fp32" and twin.weights_dtype() == "fp32"
    assert type(twin.technique) is type(preset.technique)
    keep = {"mixed_precision"}
    assert twin.technique.model_dump(exclude=keep) == preset.technique.model_dump(exclude=keep)
    for field in ("lora", "lora_settings", "gradient_checkpointing", "cpu_ram_efficient_loading"):
        assert getattr(twin, field) == getattr(preset, field), field
    assert twin.activation_checkpointing() == preset.activation_checkpointing()
    assert twin.registered_model_name == f"{preset.registered_model_name}-tiny"
    with pytest.raises(ValueError, match="no tiny architecture"):
        sft.tiny_twin(preset.model_copy(update={"model": "Qwen/Qwen3-0.6B"}))


def test_precision_checkpointing_and_efficient_loading_become_trainer_settings():
    ddp = sft.load_sft_preset("gpt-oss-20b")
    assert sft.precision_arguments(ddp) == {
        "bf16": True,
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
    }
    assert sft.precision_arguments(sft.load_sft_preset("debug_cpu")) == {}
    fsdp = sft.load_sft_preset("gpt-oss-120b")
    assert sft.precision_arguments(fsdp) == {"bf16": True}  # FSDP checkpoints itself
    assert sft.efficient_loading(fsdp, "cuda")
    assert not sft.efficient_loading(fsdp, "cpu")  # CPU ranks load as usual
    assert not sft.efficient_loading(sft.tiny_twin(fsdp), "cuda")  # built from a config
    assert not sft.efficient_loading(fsdp.with_technique(DDPConfig()), "cuda")
    assert sft.EFFICIENT_LOADING_ENV["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"


def test_ranks_but_the_first_build_the_pretrained_model_empty(tmp_path):
    tokenizer = load_tokenizer(sft.SHIPPED_TOKENIZER)
    saved = build_causal_lm("tiny-llama", tokenizer, seed=0)
    saved.save_pretrained(tmp_path)
    config = sft.SFTConfig.model_validate(
        {"model": str(tmp_path), "lora": True, "precision": "bf16", "gpu_type": "cpu"}
    )
    empty = sft.empty_pretrained_model(config)
    params = dict(empty.named_parameters())
    assert params.keys() == dict(saved.named_parameters()).keys()
    assert {p.device.type for p in params.values()} == {"meta"}
    assert {p.dtype for p in params.values()} == {torch.bfloat16}  # the frozen base's dtype
    buffers = dict(empty.named_buffers())
    assert buffers and all(b.device.type == "cpu" for b in buffers.values())  # rotary, real
    assert all(params[k].shape == v.shape for k, v in saved.named_parameters())
