"""Model FLOPs utilisation of SFT-style training on one GPU in bf16: a tiny Llama and a 1B one.

Each model is built from its config (no weights are downloaded): the project's tiny Llama and
a Llama with Llama-3.2-1B's dimensions (hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192, vocabulary 128256, tied embeddings). Each trains with AdamW on random token
batches under bf16 autocast for `--warmup` steps, then `--steps` timed steps. Tokens/s counts
every token (the batches have no padding); MFU is the model FLOPs per token
(`trainflow.efficiency.training_flops`: 6 per linear weight, plus attention) times tokens/s
over the GPU's peak dense bf16 FLOP/s (`peak_bf16_flops`; null for a GPU not in the table).
Prints one JSON line::

    python -m benchmarks.mfu [--steps 20] [--warmup 5]
    python -m benchmarks.mfu --models llama-3.2-1b-shape --batch-size 8 --compile
    python -m benchmarks.mfu --cpu      # no GPU: the tiny model only, in fp32, mfu null

`--compile` wraps the model in `torch.compile` (compiled during the warm-up steps, which are
not timed); `--batch-size` replaces each model's batch size (sequences of its `seq_len`).

Without CUDA (and without `--cpu`) it says so in one line and exits with status 2.
"""

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from trainflow.efficiency import (
    matmul_params,
    mfu,
    peak_bf16_flops,
    peak_memory_mb,
    training_flops,
)


@dataclass(frozen=True)
class Case:
    """A model to measure and the batch it trains on."""

    name: str
    batch_size: int
    seq_len: int


TINY = Case("tiny-llama", batch_size=32, seq_len=256)
LLAMA_1B = Case("llama-3.2-1b-shape", batch_size=4, seq_len=2048)
CASES = {case.name: case for case in (TINY, LLAMA_1B)}


def build(case: Case, device: torch.device) -> Any:
    """The model of `case`, freshly initialised on `device` (fp32 weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if case.name == TINY.name:
        from trainflow.configs.sft import SHIPPED_TOKENIZER
        from trainflow.data.tokenizer import load_tokenizer
        from trainflow.models.causal_lm import build_causal_lm

        tokenizer = load_tokenizer(SHIPPED_TOKENIZER)
        return build_causal_lm("tiny-llama", tokenizer, seed=0, pretrained=False).to(device)
    config = LlamaConfig(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=max(case.seq_len, 2048),
        rope_theta=500000.0,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config)


def measure(
    case: Case, device: torch.device, steps: int, warmup: int, compile: bool = False
) -> dict[str, Any]:
    """Train `case` on random tokens; tokens/s over the timed steps, MFU, peak memory."""
    model = build(case, device).train()
    config = model.config
    forward = torch.compile(model) if compile else model
    flops_per_token = training_flops(
        matmul_params(model),
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        seq_len=case.seq_len,
    )
    on_gpu = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_gpu)
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (case.batch_size, case.seq_len)

    def step() -> None:
        tokens = torch.randint(config.vocab_size, shape, device=device, generator=generator)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
            loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    warm_started = time.perf_counter()
    for _ in range(warmup):
        step()
    if on_gpu:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    warmup_s = time.perf_counter() - warm_started
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if on_gpu:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - started
    tokens_per_s = case.batch_size * case.seq_len * steps / elapsed
    peak = peak_bf16_flops(torch.cuda.get_device_name(device)) if on_gpu else None
    result = {
        "params": sum(p.numel() for p in model.parameters()),
        "batch_size": case.batch_size,
        "seq_len": case.seq_len,
        "tokens_per_s": round(tokens_per_s, 1),
        "step_time_s": round(elapsed / steps, 4),
        "warmup_s": round(warmup_s, 1),
        "compiled": compile,
        "flops_per_token": flops_per_token,
        "mfu": round(mfu(flops_per_token, tokens_per_s, peak, 1), 4) if peak else None,
        "peak_memory_mb": round(peak_memory_mb(device), 1),
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per model")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=sorted(CASES),
        help="the models to measure (default: both on a GPU, the tiny one with --cpu)",
    )
    parser.add_argument(
        "--batch-size", type=int, help="sequences per step for every model (default: each own)"
    )
    parser.add_argument("--compile", action="store_true", help="train through torch.compile(model)")
    parser.add_argument(
        "--cpu", action="store_true", help="no GPU: the tiny model only, on the CPU, mfu null"
    )
    args = parser.parse_args()
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.cpu:
        device, cases = torch.device("cpu"), [CASES[n] for n in args.models or [TINY.name]]
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
        cases = [CASES[n] for n in args.models or [TINY.name, LLAMA_1B.name]]
    else:
        print(
            "benchmarks.mfu: no CUDA device here; MFU needs a GPU (--cpu runs the tiny model "
            "on the CPU, mfu null)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    models = {}
    for case in cases:
        if args.batch_size is not None:
            case = replace(case, batch_size=args.batch_size)
        models[case.name] = measure(case, device, args.steps, args.warmup, args.compile)
        gc.collect()  # the model and its optimizer state, before the next model is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        json.dumps(
            {
                "benchmark": "mfu",
                "device": name,
                "peak_bf16_flops": peak_bf16_flops(name) if device.type == "cuda" else None,
                "dtype": "bf16-autocast" if device.type == "cuda" else "fp32",
                "steps": args.steps,
                "models": models,
            }
        )
    )


if __name__ == "__main__":
    main()
