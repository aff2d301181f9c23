"""Unsloth on our ranks: LoRA fine-tuning the way Unsloth's users write it.

`train(config_path, overrides)` runs on every rank of a torch elastic launch (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) from Unsloth's own environment, `.venvs/unsloth`
(`bash scripts/setup-framework.sh unsloth`): `FastLanguageModel.from_pretrained`, then
`FastLanguageModel.get_peft_model` (LoRA), then TRL's `SFTTrainer`. With several ranks this is
Unsloth's multi-GPU DDP: one process per GPU, each with the whole model on `cuda:LOCAL_RANK`
(transformers' Trainer wraps it in DistributedDataParallel). Global rank 0 saves the result.

Without a CUDA GPU, `import unsloth` (2026.10) does not fail: it selects its CPU backend (stock
transformers + PEFT + TRL, none of Unsloth's kernels) and prints "Unsloth 2026.10.9: no GPU
found, training on CPU ...". Unsloth's switches (environment variables read by
unsloth_zoo.device_type; the first is named in that banner):

- `UNSLOTH_DISABLE_CPU_FALLBACK=1`: the import raises instead,
  `NotImplementedError: Unsloth cannot find any torch accelerator? You need a GPU.`
- `UNSLOTH_FORCE_CPU=1`: the CPU backend even where a GPU is present.
- An NVIDIA driver that torch cannot use (wrong torch build) never falls back to the CPU: the
  import raises.

`check_can_train` tells these cases apart before anything is launched (for the environment of
the process that calls it: CPU ranks get CUDA_VISIBLE_DEVICES=""), and a config may refuse the
CPU backend outright (`require_gpu: true`, as the Llama 3.2 3B preset does).

This module imports only the standard library at module level, so our main environment can
import it; `unsloth` is imported inside `train`, before transformers and TRL, as Unsloth requires.

Config (YAML, Unsloth's terms; see trainflow/presets/frameworks/unsloth-*.yaml):
    model_name, tokenizer_name, max_seq_length, load_in_4bit, dtype, require_gpu, env,
    chat_template, train_on_responses_only {instruction_part, response_part},
    lora {r, alpha, dropout, target_modules, use_gradient_checkpointing, bias, use_rslora},
    dataset {path, split, max_samples}, training {any trl.SFTConfig argument},
    save_method (merged_16bit | lora), output_dir.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from trainflow.frameworks import progress

REPO_ROOT = Path(__file__).resolve().parents[2]
PRESETS = REPO_ROOT / "trainflow" / "presets" / "frameworks"
TINY_CONFIG = PRESETS / "unsloth-tiny.yaml"
LLAMA_3B_CONFIG = PRESETS / "unsloth-llama-3.2-3b.yaml"

TOP_LEVEL_KEYS = (
    "model_name",
    "tokenizer_name",
    "max_seq_length",
    "load_in_4bit",
    "dtype",
    "require_gpu",
    "env",
    "chat_template",
    "train_on_responses_only",
    "lora",
    "dataset",
    "training",
    "save_method",
    "output_dir",
)
SAVE_METHODS = ("merged_16bit", "lora")
# Overrides that name a nested key by its leaf (`max_steps` is `training.max_steps`).
OVERRIDE_SHORTHANDS = {
    "max_steps": ("training", "max_steps"),
    "learning_rate": ("training", "learning_rate"),
    "per_device_train_batch_size": ("training", "per_device_train_batch_size"),
    "gradient_accumulation_steps": ("training", "gradient_accumulation_steps"),
    "seed": ("training", "seed"),
    "dataset_path": ("dataset", "path"),
    "max_samples": ("dataset", "max_samples"),
    "lora_r": ("lora", "r"),
}
GPU_MESSAGE = "Unsloth needs a CUDA GPU"


# ------------------------------------------------------------------ config


def load_config(config_path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> dict:
    """The YAML config at `config_path` with `overrides` applied (see `apply_overrides`)."""
    import yaml

    with open(config_path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a mapping at the top level")
    unknown = sorted(set(config) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ValueError(f"{config_path}: unknown keys {unknown}; known: {list(TOP_LEVEL_KEYS)}")
    return apply_overrides(config, overrides or {})


def apply_overrides(config: dict, overrides: dict[str, Any]) -> dict:
    """A copy of `config` with `overrides` applied.

    Keys: a top-level key (`model_name`, `output_dir`, ...; a mapping replaces the whole
    section), a dotted path (`training.max_steps`, `lora.r`), or a shorthand: `max_steps`,
    `learning_rate`, `per_device_train_batch_size`, `gradient_accumulation_steps`, `seed`
    (training.*), `lora_r`, `max_samples`, and `dataset` / `dataset_path` given as a path
    (replaces dataset.path only).
    """
    import copy

    config = copy.deepcopy(config)
    for key, value in overrides.items():
        path: tuple[str, ...]
        if key == "dataset" and isinstance(value, (str, os.PathLike)):
            path = ("dataset", "path")
            value = os.fspath(value)
        elif key in OVERRIDE_SHORTHANDS:
            path = OVERRIDE_SHORTHANDS[key]
        elif "." in key:
            path = tuple(key.split("."))
        elif key in TOP_LEVEL_KEYS:
            path = (key,)
        else:
            raise ValueError(
                f"unknown override {key!r}: use a top-level key {list(TOP_LEVEL_KEYS)}, "
                f"a dotted path (training.max_steps) or one of {sorted(OVERRIDE_SHORTHANDS)}"
            )
        if path[0] not in TOP_LEVEL_KEYS:
            raise ValueError(f"unknown override {key!r}: {path[0]!r} is not a config section")
        node = config
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {key!r}: {part!r} is not a mapping in the config")
        node[path[-1]] = value
    return config


def pipeline_overrides(
    *,
    base_model: str,
    tokenizer: str | None,
    data: str,
    output_dir: str,
    max_steps: int | None,
    max_length: int | None,
) -> dict[str, Any]:
    """The overrides our pipeline gives `train`: what it owns in the config.

    The base model (a Hub id or a folder), its tokenizer when it is another one, the prepared
    chat JSONL, the output folder, and the steps and sequence length when given.
    """
    overrides: dict[str, Any] = {
        "model_name": base_model,
        "dataset": data,
        "output_dir": output_dir,
    }
    if tokenizer and tokenizer != base_model:
        overrides["tokenizer_name"] = tokenizer
    if max_steps is not None:
        overrides["max_steps"] = int(max_steps)
    if max_length is not None:
        overrides["max_seq_length"] = int(max_length)
    return overrides


# ------------------------------------------------------------------ can it train here?


def _nvidia_driver_loaded() -> bool:
    """Unsloth's own test: the kernel driver, unless CUDA_VISIBLE_DEVICES hides every GPU."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None and "".join(mask.split()) in ("", "-1"):
        return False
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists(
        "/usr/lib/wsl/lib/nvidia-smi"
    )


def _cpu_forced() -> bool:
    """UNSLOTH_FORCE_CPU=1: Unsloth's CPU backend even with a GPU (UNSLOTH_ALLOW_CPU=1, its test
    spoof, wins)."""
    return (
        os.environ.get("UNSLOTH_FORCE_CPU", "0") == "1"
        and os.environ.get("UNSLOTH_ALLOW_CPU", "0") != "1"
    )


def check_can_train(
    config_path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None
) -> str | None:
    """Why Unsloth cannot train here (a message starting "Unsloth needs a CUDA GPU"), else None.

    Cheap (imports torch, not unsloth) and the same in our main environment and in
    .venvs/unsloth (both have torch 2.14.1), so the pipeline can call it before launching.
    Without a CUDA GPU it answers None when Unsloth would train on its CPU backend, and a
    reason when it would not: `UNSLOTH_DISABLE_CPU_FALLBACK=1`, an NVIDIA driver that torch
    cannot use; or, given a config, `require_gpu: true`, or a 4-bit model to be saved merged
    (Unsloth's CPU backend trains it, then refuses the merge).
    """
    config = load_config(config_path, overrides) if config_path is not None else {}
    import torch

    if torch.cuda.is_available() and not _cpu_forced():
        return None
    if _cpu_forced():
        where = "UNSLOTH_FORCE_CPU=1 selects Unsloth's CPU backend"
    else:
        build = f"torch {torch.__version__}" + (
            f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (a CPU-only build)"
        )
        if os.environ.get("UNSLOTH_DISABLE_CPU_FALLBACK", "0") == "1":
            return (
                f"{GPU_MESSAGE}: {build} sees no CUDA device and UNSLOTH_DISABLE_CPU_FALLBACK=1 "
                "turns off Unsloth's CPU backend (`import unsloth` raises NotImplementedError: "
                "Unsloth cannot find any torch accelerator? You need a GPU.)"
            )
        if _nvidia_driver_loaded():
            return (
                f"{GPU_MESSAGE} that torch can use: an NVIDIA driver is loaded but {build} "
                "cannot use it (torch.cuda.is_available() is False), and Unsloth then refuses "
                "its CPU fallback"
            )
        where = f"{build} sees no CUDA device (Unsloth would train on its CPU backend)"
    if config.get("require_gpu"):
        return f"{GPU_MESSAGE}: this config sets require_gpu: true and {where}"
    if config.get("load_in_4bit") and config.get("save_method", "merged_16bit") != "lora":
        return (
            f"{GPU_MESSAGE} to merge LoRA into a 4-bit model: {where}, which refuses that merge "
            "after training (NotImplementedError: Unsloth (CPU): merging LoRA into a 4-bit model "
            "is not supported on CPU yet); set load_in_4bit: false or save_method: lora"
        )
    return None


def backend() -> str:
    """Where Unsloth would train in this process: "cuda" or "cpu" (after check_can_train)."""
    import torch

    return "cuda" if torch.cuda.is_available() and not _cpu_forced() else "cpu"


# ------------------------------------------------------------------ helpers


def _resolve(path: str, must_exist: bool) -> str:
    """`path` made absolute: against the working directory, or the repo when only it has it."""
    p = Path(os.path.expanduser(path))
    if p.is_absolute():
        return str(p)
    if must_exist and not p.exists() and (REPO_ROOT / p).exists():
        return str(REPO_ROOT / p)
    return str(p.resolve())


def _rank_env() -> tuple[int, int, int]:
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return rank, local_rank, world_size


def _load_rows(dataset_cfg: dict):
    """The training rows: a JSONL file of chat rows, or a `datasets` folder (save_to_disk)."""
    import datasets

    path = _resolve(str(dataset_cfg["path"]), must_exist=True)
    split = dataset_cfg.get("split", "train")
    if os.path.isdir(path):
        loaded = datasets.load_from_disk(path)
        rows = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    elif os.path.isfile(path):
        rows = datasets.load_dataset("json", data_files=path, split="train")
    else:
        raise FileNotFoundError(f"dataset {path!r}: no such file or folder")
    if "messages" not in rows.column_names:
        raise ValueError(
            f"dataset {path!r}: rows need a 'messages' column, have {rows.column_names}"
        )
    max_samples = dataset_cfg.get("max_samples")
    if max_samples is not None:
        rows = rows.select(range(min(int(max_samples), len(rows))))
    return rows


def _finite(value: Any) -> float | None:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def _is_local(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and (
        os.path.exists(path) or (REPO_ROOT / path).exists()
    )


def _default_env(config: dict) -> None:
    """The config's `env`, then: all inputs on local disk -> keep the Hugging Face Hub out."""
    for name, value in (config.get("env") or {}).items():
        os.environ.setdefault(str(name), str(value))
    inputs = [config.get("model_name"), config.get("tokenizer_name") or config.get("model_name")]
    inputs.append((config.get("dataset") or {}).get("path"))
    if all(_is_local(p) for p in inputs):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


# ------------------------------------------------------------------ the rank function


def train(config_path: str, overrides: dict, progress_file: str | None = None) -> dict:
    """Fine-tune with Unsloth on this rank; global rank 0 saves the model.

    Args:
        config_path: An Unsloth YAML config (trainflow/presets/frameworks/unsloth-*.yaml).
        overrides: See `apply_overrides`; the pipeline's are `pipeline_overrides`
            (model_name, tokenizer_name, dataset, output_dir, max_steps, max_seq_length).
        progress_file: Where rank 0 writes its progress each step; every rank also records
            heartbeats (`trainflow.frameworks.progress`).

    Raises RuntimeError("Unsloth needs a CUDA GPU: ...") before loading anything when
    `check_can_train` gives a reason. Returns, the same on every rank:
        output_dir / model_dir: the saved model folder, `<config output_dir>/<save_method>`:
            merged 16-bit weights + tokenizer, a plain Hugging Face folder (`merged_16bit`),
            or the LoRA adapter + tokenizer (`lora`). Global rank 0 writes it.
        save_method; train_loss (the last logged loss, averaged over ranks); train_loss_mean
        (the trainer's mean over the run); loss_history ([[step, loss], ...]); steps and
        global_step; max_steps; train_runtime_s; world_size; rank; device ("cuda", or "cpu":
        Unsloth's CPU backend); version (unsloth's); model_name.
    """
    config = load_config(config_path, overrides)
    reason = check_can_train(config_path, overrides)
    if reason is not None:
        raise RuntimeError(reason)
    save_method = config.get("save_method", "merged_16bit")
    if save_method not in SAVE_METHODS:
        raise ValueError(f"save_method {save_method!r}: use one of {SAVE_METHODS}")
    for key in ("model_name", "dataset", "output_dir"):
        if not config.get(key):
            raise ValueError(f"{config_path}: {key!r} is required")

    _default_env(config)
    rank, local_rank, world_size = _rank_env()
    device = backend()
    device_map: Any = "cpu"
    if device == "cuda":
        import torch

        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(
                f"{GPU_MESSAGE} per rank: LOCAL_RANK={local_rank} but this process sees {count} "
                "GPU(s); every rank must see all of the node's GPUs and use cuda:LOCAL_RANK"
            )
        torch.cuda.set_device(local_rank)
        device_map = {"": f"cuda:{local_rank}"}

    # Unsloth patches transformers, TRL and PEFT when imported: it must come first.
    import unsloth  # first: before transformers / trl
    from trl import SFTConfig, SFTTrainer
    from unsloth import FastLanguageModel, is_bfloat16_supported

    model_name = str(config["model_name"])
    if os.path.exists(model_name) or os.path.exists(REPO_ROOT / model_name):
        model_name = _resolve(model_name, must_exist=True)  # a local folder, else a Hub id
    max_seq_length = int(config.get("max_seq_length", 2048))
    extra: dict[str, Any] = {}
    if config.get("tokenizer_name"):
        tokenizer_name = str(config["tokenizer_name"])
        if _is_local(tokenizer_name):
            tokenizer_name = _resolve(tokenizer_name, must_exist=True)
        extra["tokenizer_name"] = tokenizer_name
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=model_name,
        max_seq_length=max_seq_length,
        dtype=config.get("dtype"),
        load_in_4bit=bool(config.get("load_in_4bit", False)),
        device_map=device_map,
        **extra,
    )
    if config.get("chat_template"):
        from unsloth.chat_templates import get_chat_template

        tokenizer = get_chat_template(tokenizer, chat_template=config["chat_template"])

    lora = dict(config.get("lora") or {})
    training = dict(config.get("training") or {})
    model = FastLanguageModel.get_peft_model(
        model,
        r=int(lora.get("r", 16)),
        target_modules=list(
            lora.get(
                "target_modules",
                ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            )
        ),
        lora_alpha=int(lora.get("alpha", 16)),
        lora_dropout=float(lora.get("dropout", 0)),
        bias=lora.get("bias", "none"),
        use_gradient_checkpointing=lora.get("use_gradient_checkpointing", "unsloth"),
        random_state=int(training.get("seed", 3407)),
        use_rslora=bool(lora.get("use_rslora", False)),
    )

    rows = _load_rows(dict(config["dataset"]))

    # A tokenizer that adds BOS itself (Llama 3's) would get a second one from the chat
    # template's text: strip the template's.
    bos = getattr(tokenizer, "bos_token", None)
    adds_bos = bool(bos) and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]

    def to_text(batch):
        texts = [
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
            for messages in batch["messages"]
        ]
        if adds_bos:
            texts = [text.removeprefix(bos) for text in texts]
        return {"text": texts}

    rows = rows.map(to_text, batched=True, remove_columns=rows.column_names)

    output_dir = _resolve(str(config["output_dir"]), must_exist=False)
    bf16 = is_bfloat16_supported()
    args = {
        "output_dir": os.path.join(output_dir, "checkpoints"),
        "dataset_text_field": "text",
        "max_length": max_seq_length,
        "packing": False,
        "report_to": "none",
        "save_strategy": "no",
        "bf16": bf16,
        "fp16": not bf16 and device == "cuda",
        "ddp_find_unused_parameters": False,
        "dataset_num_proc": 1,
    }
    args.update(training)
    trainer = SFTTrainer(
        model=model,
        processing_class=tokenizer,
        train_dataset=rows,
        args=SFTConfig(**args),
    )
    if config.get("train_on_responses_only"):
        from unsloth.chat_templates import train_on_responses_only

        parts = config["train_on_responses_only"]
        trainer = train_on_responses_only(
            trainer,
            instruction_part=parts["instruction_part"],
            response_part=parts["response_part"],
        )

    trainer.add_callback(progress.trainer_callback(progress_file))
    result = trainer.train()
    state = trainer.state
    history = [
        [int(entry.get("step", 0)), float(entry["loss"])]
        for entry in state.log_history
        if _finite(entry.get("loss")) is not None
    ]
    summary = next((e for e in reversed(state.log_history) if "train_runtime" in e), {})

    model_dir = os.path.join(output_dir, save_method)
    if trainer.is_world_process_zero():
        model.config.use_cache = True  # training turned the KV cache off; generation wants it
        if save_method == "lora":
            model.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
        else:
            model.save_pretrained_merged(model_dir, tokenizer, save_method=save_method)
    trainer.accelerator.wait_for_everyone()

    return {
        "framework": "unsloth",
        "output_dir": model_dir,
        "model_dir": model_dir,
        "save_method": save_method,
        "train_loss": history[-1][1] if history else None,
        "train_loss_mean": _finite(result.training_loss),
        "loss_history": history,
        "steps": int(state.global_step),
        "global_step": int(state.global_step),
        "max_steps": int(state.max_steps),
        "train_runtime_s": _finite(summary.get("train_runtime")),
        "world_size": world_size,
        "rank": rank,
        "device": device,
        "version": getattr(unsloth, "__version__", None),
        "model_name": model_name,
    }


def main(argv: list[str] | None = None) -> int:
    """`torchrun ... -m trainflow.frameworks.unsloth CONFIG [--overrides JSON] [--result-dir DIR]`.

    Runs `train` on this rank; with --result-dir, writes its return value to DIR/rank{RANK}.json.
    """
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m trainflow.frameworks.unsloth")
    parser.add_argument("config", help="an Unsloth YAML config (trainflow/presets/frameworks)")
    parser.add_argument("--overrides", default="{}", help="JSON object of overrides")
    parser.add_argument("--result-dir", help="write each rank's result here as rank{RANK}.json")
    args = parser.parse_args(argv)
    result = train(args.config, json.loads(args.overrides))
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        path = os.path.join(args.result_dir, f"rank{os.environ.get('RANK', '0')}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
