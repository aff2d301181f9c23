"""Causal language models for fine-tuning: tiny offline architectures, or any Hub checkpoint.

A model name is either one of `TINY_ARCHITECTURES` (built from a config with the tokenizer's
vocabulary, randomly initialised: runs offline in seconds on a CPU) or a Hugging Face model id
or local directory (`meta-llama/Llama-3.2-1B-Instruct`), loaded with its pretrained weights.
"""

from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GptOssConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    }


def _tiny_llama(tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    return LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **_special_ids(tokenizer),
    )


def _tiny_gpt_oss(tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    # Mixture of experts: 4 experts, 2 routed per token, alternating sliding/full attention.
    return GptOssConfig(
        hidden_size=64,
        intermediate_size=64,
        head_dim=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=32,
        layer_types=["sliding_attention", "full_attention"],
        **_special_ids(tokenizer),
    )


TINY_ARCHITECTURES: dict[str, Callable[[PreTrainedTokenizerBase], PretrainedConfig]] = {
    "tiny-llama": _tiny_llama,
    "tiny-gpt-oss": _tiny_gpt_oss,
}


def is_tiny(name: str) -> bool:
    """True when `name` is a tiny architecture built from a config (no pretrained weights)."""
    return name in TINY_ARCHITECTURES


def model_config(name: str, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The architecture config of `name` (for a Hub model, only its config is fetched)."""
    if is_tiny(name):
        return TINY_ARCHITECTURES[name](tokenizer)
    return AutoConfig.from_pretrained(name)


def build_causal_lm(
    name: str, tokenizer: PreTrainedTokenizerBase, *, seed: int, pretrained: bool = True
) -> PreTrainedModel:
    """The model `name`: a seeded random init for tiny ones, else the pretrained checkpoint.

    Args:
        name: A `TINY_ARCHITECTURES` key, a Hub model id or a local model directory.
        tokenizer: Tokenizer whose vocabulary and special tokens a tiny model adopts.
        seed: Seed of a tiny model's initial weights.
        pretrained: False builds the architecture only (used on the meta device to check
            that a technique can shard it).
    """
    if is_tiny(name) or not pretrained:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(model_config(name, tokenizer))
    return AutoModelForCausalLM.from_pretrained(name)
