"""Memory estimates per GPU, the fit check before launch, and `--technique auto`."""

import os
import stat
from typing import Any

import pytest
import torch
from transformers import GptOssConfig, LlamaConfig

from flows import command
from trainflow import memory, tracking
from trainflow.configs.sft import SHIPPED_TOKENIZER
from trainflow.data.tokenizer import load_tokenizer
from trainflow.memory import (
    GB,
    KNOWN_MODELS,
    Available,
    MemoryFitError,
    TrainingSetup,
    estimate,
)
from trainflow.models.causal_lm import build_causal_lm
from trainflow.strategies import DDPConfig, DeepSpeedConfig, FSDPConfig
from trainflow.workloads import sft_startup


def _parse(argv: list[str]) -> Any:
    return command.parse_args("sft", argv)


LLAMA_1B = KNOWN_MODELS["meta-llama/Llama-3.2-1B-Instruct"]
GPT_OSS_120B = KNOWN_MODELS["openai/gpt-oss-120b"]
BF16_8 = TrainingSetup(micro_batch_size=4, seq_len=2048, world_size=8, precision="bf16")


def _states(e: memory.Estimate) -> float:
    return (e.params + e.grads + e.optimizer) / GB


def _plan(argv: list[str]) -> memory.MemoryPlan:
    return memory.plan_sft(_parse(argv), detect=False)


def test_full_finetune_with_ddp_is_16_bytes_per_parameter_plus_activations():
    e = estimate(LLAMA_1B, BF16_8, DDPConfig())
    assert LLAMA_1B.params == pytest.approx(1.24e9, rel=0.01)
    assert _states(e) == pytest.approx(LLAMA_1B.params * 16 / GB)  # 19.8 GB
    assert 19 < _states(e) < 21
    assert e.buffers == pytest.approx(LLAMA_1B.params * 4)  # DDP's gradient buckets
    assert e.activations > 0 and e.logits == 4 * 2048 * 128256 * 10
    assert e.total_gb == pytest.approx(sum(e.parts().values()))
    assert e.breakdown().endswith(f"= {e.total_gb:.1f} GB per GPU")


def test_zero_stages_and_fsdp_divide_the_states_they_shard_by_the_world_size():
    n, w = LLAMA_1B.params, 8
    by = {
        stage: estimate(LLAMA_1B, BF16_8, DeepSpeedConfig(zero_stage=stage, mixed_precision="bf16"))
        for stage in (1, 2, 3)
    }
    # The ZeRO paper's mixed-precision Adam: 2 (bf16 params) + 2 (bf16 grads) + 12 (fp32 states).
    assert by[1].params == 2 * n and by[1].grads == 2 * n and by[1].optimizer == 12 * n / w
    assert by[2].params == 2 * n and by[2].grads == 2 * n / w
    assert _states(by[3]) == pytest.approx(16 * n / w / GB)  # ZeRO-3 over 8: 16/8 per param
    fsdp = estimate(LLAMA_1B, BF16_8, FSDPConfig(mixed_precision="bf16"))
    assert _states(fsdp) == pytest.approx(_states(by[3]))
    assert fsdp.buffers > 0 and by[3].buffers == fsdp.buffers  # gathered layers and head
    offload = estimate(LLAMA_1B, BF16_8, FSDPConfig(cpu_offload=True))
    assert _states(offload) == 0 and offload.host == pytest.approx(16 * n / w)
    gathered = estimate(LLAMA_1B, BF16_8, FSDPConfig(reshard_after_forward=False))
    assert gathered.buffers > fsdp.buffers


def test_lora_keeps_the_frozen_base_in_bf16_and_trains_only_the_adapters():
    setup = TrainingSetup(
        micro_batch_size=2,
        seq_len=2048,
        world_size=8,
        precision="bf16",
        weights_dtype="bf16",
        lora_rank=16,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
    )
    e = estimate(KNOWN_MODELS["openai/gpt-oss-20b"], setup, DDPConfig())
    adapters = memory.lora_params(KNOWN_MODELS["openai/gpt-oss-20b"], 16, setup.lora_targets)
    assert 5e6 < adapters < 1e7
    assert e.params == pytest.approx((20.91e9 - adapters) * 2 + adapters * 4)  # ~42 GB
    assert e.grads == adapters * 4 and e.optimizer == adapters * 8


def test_lora_adapter_count_matches_peft_on_a_real_model():
    from peft import LoraConfig, get_peft_model

    tokenizer = load_tokenizer(SHIPPED_TOKENIZER)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    model = get_peft_model(
        build_causal_lm("tiny-llama", tokenizer, seed=0), LoraConfig(r=8, target_modules=targets)
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = memory.model_shape("tiny-llama", SHIPPED_TOKENIZER)
    assert memory.lora_params(shape, 8, targets) == trainable


def test_activation_checkpointing_keeps_only_layer_inputs_and_one_layer():
    plain = estimate(LLAMA_1B, BF16_8, DDPConfig())
    ckpt = TrainingSetup(**{**BF16_8.__dict__, "activation_checkpointing": True})
    assert estimate(LLAMA_1B, ckpt, DDPConfig()).activations < plain.activations / 5


def test_table_shapes_agree_with_the_architectures_built_on_the_meta_device():
    llama = LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
    )
    built = memory.shape_from_config("llama", llama, "config")
    assert built.params == LLAMA_1B.params and built.eager_attention is False
    oss = GptOssConfig(num_hidden_layers=24, num_local_experts=32, vocab_size=201088)
    built = memory.shape_from_config("gpt-oss", oss, "config")
    table = KNOWN_MODELS["openai/gpt-oss-20b"]
    assert built.params == pytest.approx(table.params, rel=0.002)
    assert built.active_params == pytest.approx(table.active_params, rel=0.2)
    assert built.eager_attention and (built.hidden_size, built.head_dim) == (2880, 64)


def test_tiny_shape_counts_the_parameters_of_the_model_the_ranks_build():
    tokenizer = load_tokenizer(SHIPPED_TOKENIZER)
    for name in ("tiny-llama", "tiny-gpt-oss"):
        model = build_causal_lm(name, tokenizer, seed=0)
        shape = memory.model_shape(name, SHIPPED_TOKENIZER)
        assert shape.params == sum(p.numel() for p in model.parameters())
        assert shape.vocab_size == len(tokenizer)
    assert not torch.cuda.is_initialized()


def test_ddp_for_gpt_oss_120b_on_8_h100_is_refused_naming_both_numbers():
    with pytest.raises(MemoryFitError) as refused:
        _plan(["--preset", "gpt-oss-120b", "--technique", "ddp"])
    message = str(refused.value)
    needed = estimate(
        GPT_OSS_120B,
        command.parse_args(
            "sft", ["--preset", "gpt-oss-120b", "--technique", "ddp"]
        ).training_setup(),
        DDPConfig(),
    )
    assert f"needs an estimated {needed.total_gb:.1f} GB per GPU" in message
    assert "but 80.0 GB per GPU (H100 from the GPU table) is available" in message
    assert "params 233.7" in message and "activations" in message and "--technique auto" in message


def test_the_shipped_gpu_presets_fit_their_gpus():
    for preset in ("gpt-oss-20b", "gpt-oss-120b", "llama-3.2-1b-zero3", "h100"):
        plan = _plan(["--preset", preset])
        assert plan.checked and plan.estimate.total_gb < 80, preset
    # Two nodes halve the sharded base of gpt-oss-120b.
    two = _plan(["--preset", "gpt-oss-120b", "--gpus", "16", "--nnodes", "2"])
    assert two.estimate.params == pytest.approx(
        _plan(["--preset", "gpt-oss-120b"]).estimate.params / 2
    )


def test_auto_picks_ddp_when_a_replica_fits_and_prints_the_estimate(capsys):
    config = command.parse_args(
        "sft", ["--preset", "llama-3.2-1b-zero3", "--technique", "auto", "--gpu-memory-gb", "80"]
    )
    plan = sft_startup.plan_memory(config)
    out = capsys.readouterr().out
    assert isinstance(plan.technique, DDPConfig) and plan.requested == "auto"
    assert "memory estimate: meta-llama/Llama-3.2-1B-Instruct (1.24B params; table)" in out
    assert "available: 80.0 GB per GPU (--gpu-memory-gb)" in out
    assert f"ddp: {plan.estimate.breakdown()}: fits" in out
    assert out.strip().endswith("technique auto -> ddp")
    resolved = config.with_technique(plan.technique)
    assert resolved.technique == DDPConfig() and resolved.precision == "bf16"


def test_auto_shards_gpt_oss_120b_on_8_h100_after_ddp_and_zero2_do_not_fit(capsys):
    config = command.parse_args(
        "sft", ["--preset", "gpt-oss-120b", "--technique", "auto", "--gpu-memory-gb", "80"]
    )
    plan = sft_startup.plan_memory(config)
    out = capsys.readouterr().out
    assert isinstance(plan.technique, FSDPConfig) and not plan.technique.cpu_offload
    assert plan.technique.activation_checkpointing and plan.technique.mixed_precision == "bf16"
    assert [e.technique for e in plan.tried[:2]] == ["ddp", "deepspeed (mixed_precision='bf16')"]
    assert out.count("does not fit") == 2 and plan.estimate.total_gb <= 80
    assert "technique auto -> fsdp (mixed_precision='bf16', activation_checkpointing=True)" in out
    resolved = config.with_technique(plan.technique)
    assert resolved.technique == plan.technique and resolved.cpu_ram_efficient_loading
    # Full fine-tuning of all 117B parameters only fits with the states in host RAM.
    full = _plan(["--preset", "gpt-oss-120b", "--technique", "auto", "--no-lora"])
    assert isinstance(full.technique, FSDPConfig) and full.technique.cpu_offload
    assert full.estimate.host == pytest.approx(116.83e9 * 16 / 8, rel=0.01)


def test_auto_refuses_with_every_estimate_when_nothing_fits():
    argv = ["--preset", "gpt-oss-120b", "--technique", "auto", "--no-lora"]
    with pytest.raises(MemoryFitError) as refused:
        _plan([*argv, "--gpu-memory-gb", "24", "--training-per-device-batch-size", "16"])
    message = str(refused.value)
    assert "no technique fits openai/gpt-oss-120b" in message and "24.0 GB per GPU" in message
    for tried in ("ddp:", "deepspeed (mixed_precision='bf16'):", "cpu_offload=True):"):
        assert tried in message
    assert "GB per GPU" in message and "per_device_batch_size" in message


def test_cpu_ranks_report_the_estimate_and_refuse_nothing():
    plan = _plan(["--preset", "gpt-oss-120b", "--technique", "ddp", "--gpu-type", "cpu"])
    assert not plan.checked and plan.estimate.total_gb > 200
    assert plan.lines()[-1].endswith("GB per GPU: not checked")
    auto = _plan(["--preset", "gpt-oss-120b", "--technique", "auto", "--gpu-type", "cpu"])
    assert isinstance(auto.technique, DDPConfig)  # nothing to check: the first candidate


def test_available_memory_comes_from_the_flag_then_the_gpus_then_the_table():
    assert memory.available_memory(40, "H100", detect=False) == Available(40.0, "--gpu-memory-gb")
    assert memory.available_memory(None, "h100", detect=False).gb == 80
    assert memory.available_memory(None, "NVIDIA H200", detect=False).gb == 141
    assert memory.available_memory(None, "A10", detect=False).gb == 24
    assert memory.available_memory(None, "cpu", detect=False).gb is None
    assert memory.available_memory(None, None, detect=False).gb is None
    assert memory.available_memory(None, "MI300X", detect=False).gb is None


def test_gpu_memory_is_read_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$*" in *memory.total*) ;; *) exit 2 ;; esac\n'
        "printf 'NVIDIA H100 80GB HBM3, 81559\\nNVIDIA A10, 23028\\n'\n"
    )
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    h100 = memory.available_memory(None, "H100")
    assert h100.gb == pytest.approx(81559 * 2**20 / 1e9) and "NVIDIA H100 80GB HBM3" in h100.source
    assert memory.available_memory(None, None).gb == pytest.approx(23028 * 2**20 / 1e9)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert memory.available_memory(None, None).gb == pytest.approx(85.5, abs=0.1)
    assert memory.available_memory(None, "A10").source == "A10 from the GPU table"


def test_gpu_memory_option_is_parsed_and_checked():
    assert _parse(["--gpu-memory-gb", "80"]).gpu_memory_gb == 80.0
    assert _parse([]).gpu_memory_gb is None
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            _parse(["--gpu-memory-gb", bad])
    config = _parse(["--gpu-memory-gb", "80"])
    assert "gpu_memory_gb" not in config.training_fields()  # a resume may change GPUs


def test_the_plan_is_recorded_as_run_params_and_a_continued_run_keeps_them():
    client = tracking.store_client()
    run_id = client.create_run(client.create_experiment("memory")).info.run_id
    plan = _plan(["--preset", "gpt-oss-120b", "--technique", "auto"])
    sft_startup.record_memory_plan(run_id, plan)
    params = client.get_run(run_id).data.params
    assert params["memory.technique_requested"] == "auto"
    assert params["memory.technique_chosen"] == plan.technique.describe()
    assert params["memory.estimate_gb"] == f"{plan.estimate.total_gb:.2f}"
    assert params["memory.available_gb"] == "80.00" and params["memory.params_gb"] == "29.21"
    sft_startup.record_memory_plan(run_id, _plan(["--preset", "gpt-oss-120b"]))  # continued
    assert client.get_run(run_id).data.params == params
