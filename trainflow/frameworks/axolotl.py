"""Axolotl on one torch elastic rank: read an axolotl YAML config, apply overrides, train.

`train` runs on every rank, inside `.venvs/axolotl` (scripts/frameworks/axolotl.txt). The
launcher has already set RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (and, on CPU, ``CUDA_VISIBLE_DEVICES=""``, ``ACCELERATE_USE_CPU=true``); axolotl and
accelerate set up the process group from them. The steps are those of axolotl's own
``axolotl.cli.train.do_cli``/``do_train`` (``load_cfg`` -> ``load_datasets`` ->
``axolotl.train.train``), run in this process, keeping the trainer to report on it.

This module imports only the standard library at import time, so the main environment can
import it too; axolotl and PyYAML are imported inside `train`.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

from trainflow.frameworks import progress

#: Override keys handled here rather than copied into the config as they are.
DATASET_PATH_KEY = "dataset_path"
#: File, written into output_dir, holding the config axolotl actually ran (overrides applied).
RESOLVED_CONFIG_NAME = "axolotl_config.yaml"


def apply_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of an axolotl config with `overrides` applied.

    - a plain key (``base_model``, ``output_dir``, ``max_steps``, ``micro_batch_size``, ...)
      replaces the top-level value, with its type kept (no string coercion);
    - ``"parent__child"`` sets one key of a nested mapping (axolotl's CLI convention, e.g.
      ``fsdp_config__offload_params``);
    - ``dataset_path`` sets ``path`` of the config's single ``datasets`` entry (the pipeline's
      local JSONL); pass ``datasets`` (a list) to replace the whole list instead;
    - a value of ``None`` removes the key.
    """
    cfg = copy.deepcopy(config)
    for key, value in overrides.items():
        if key == DATASET_PATH_KEY:
            datasets = cfg.get("datasets") or []
            if len(datasets) != 1:
                raise ValueError(
                    f"override {DATASET_PATH_KEY!r} needs exactly one entry in `datasets`, "
                    f"the config has {len(datasets)}; override `datasets` instead"
                )
            datasets[0] = {**datasets[0], "path": str(value)}
            cfg["datasets"] = datasets
        elif "__" in key:
            parent, child = key.split("__", 1)
            section = cfg.get(parent)
            if not isinstance(section, dict):
                section = {}
            if value is None:
                section.pop(child, None)
            else:
                section[child] = value
            cfg[parent] = section
        elif value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


def pipeline_overrides(
    *,
    base_model: str,
    tokenizer: str | None,
    data: str,
    output_dir: str,
    max_steps: int | None,
    max_length: int | None,
) -> dict[str, Any]:
    """The overrides our pipeline gives `train`: what it owns in the axolotl YAML.

    The base model (a Hub id or a folder), its tokenizer when it is another one, the chat JSONL
    (the config's single ``datasets`` entry), the output folder, and the number of optimizer
    steps and the sequence length when given.
    """
    overrides: dict[str, Any] = {
        "base_model": base_model,
        DATASET_PATH_KEY: data,
        "output_dir": output_dir,
    }
    if tokenizer and tokenizer != base_model:
        overrides["tokenizer_config"] = tokenizer
    if max_steps is not None:
        overrides["max_steps"] = int(max_steps)
    if max_length is not None:
        overrides["sequence_len"] = int(max_length)
    return overrides


def load_config(
    config_path: str | os.PathLike[str], overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """An axolotl YAML config as a dict, with `overrides` applied (see `apply_overrides`)."""
    import yaml

    with open(config_path, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    return apply_overrides(raw, dict(overrides or {}))


_GPU_ATTENTION = ("flash_attention", "flash_attention_2", "flash_attention_3", "xformers", "sage")


def check_can_train(
    config_path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None
) -> str | None:
    """Why this axolotl config cannot train on CPU ranks, else None.

    Reads the config only (no axolotl import), so the pipeline can ask before launching. The
    reasons are the settings that need CUDA or that axolotl mishandles on CPU: half precision
    (``bf16: auto`` resolves to fp16 without a GPU), flash/xformers/sage attention, bitsandbytes
    quantization, DeepSpeed (not in .venvs/axolotl), the Triton-kernel plugins (Liger, Cut Cross
    Entropy), and a missing ``max_memory``: with more than one rank axolotl maps the model to
    device index LOCAL_RANK, an accelerator, unless ``max_memory`` makes it infer a (CPU) map.
    """
    cfg = load_config(config_path, overrides) if config_path is not None else {}
    reasons = []
    if cfg.get("bf16") in (True, "auto") or cfg.get("fp16") or cfg.get("bfloat16"):
        reasons.append("set bf16: false and fp16: false (fp32; bf16: auto becomes fp16 on CPU)")
    attn = str(cfg.get("attn_implementation") or "")
    legacy = [k for k in ("flash_attention", "xformers_attention", "sage_attention") if cfg.get(k)]
    if attn.split(":")[0] in _GPU_ATTENTION or "flash" in attn or legacy:
        reasons.append(f"attention {attn or legacy[0]} needs CUDA: use attn_implementation: sdpa")
    if cfg.get("load_in_4bit") or cfg.get("load_in_8bit") or cfg.get("adapter") == "qlora":
        reasons.append("bitsandbytes quantization (load_in_4bit/8bit, qlora) needs a GPU")
    if cfg.get("deepspeed"):
        reasons.append("deepspeed is not installed in .venvs/axolotl (scripts/frameworks)")
    gpu_plugins = [p for p in cfg.get("plugins") or [] if "liger" in p or "cut_cross_entropy" in p]
    if gpu_plugins:
        reasons.append(f"plugins {', '.join(gpu_plugins)} run Triton GPU kernels")
    if not (cfg.get("max_memory") or cfg.get("fsdp_config") or cfg.get("fsdp")):
        reasons.append(
            "set max_memory: {cpu: 8GiB}: with several ranks axolotl otherwise places the "
            "model on device LOCAL_RANK, an accelerator"
        )
    return "; ".join(reasons) or None


def _is_local(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.exists(path)


def _default_env(cfg: dict[str, Any]) -> None:
    """Environment defaults for a rank (the caller's explicit settings win)."""
    # axolotl sends usage telemetry from rank 0 unless told not to.
    os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    # All inputs on local disk and nothing to push: keep the Hugging Face Hub out of it
    # (axolotl's token check on local rank 0 is skipped as well).
    inputs = [cfg.get("base_model"), cfg.get("tokenizer_config") or cfg.get("base_model")]
    inputs += [d.get("path") for d in cfg.get("datasets") or [] if isinstance(d, dict)]
    if all(_is_local(p) for p in inputs) and not cfg.get("hub_model_id"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _write_resolved(cfg: dict[str, Any], output_dir: Path, rank: int) -> Path:
    """Write the resolved config into output_dir; each rank replaces it atomically."""
    import yaml

    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / RESOLVED_CONFIG_NAME
    tmp = output_dir / f".{RESOLVED_CONFIG_NAME}.rank{rank}.tmp"
    tmp.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    os.replace(tmp, final)
    return final


def _tokenizer_config_for_older_transformers(output_dir: Path) -> bool:
    """Let transformers 4.x load the tokenizer saved in output_dir, as 5.x does.

    The main environment reads either form; a registered model is also loaded by consumers
    still on transformers 4 (and by the LLM Foundry and Unsloth environments).

    transformers 5 writes ``"tokenizer_class": "TokenizersBackend"``, a name 4.x does not
    know ("Tokenizer class TokenizersBackend does not exist"); ``PreTrainedTokenizerFast``
    names the same tokenizer.json-backed class in both. Every rank saves the tokenizer, so
    every rank runs this after its own save (idempotent, atomic replace).
    """
    import json
    import time

    path = output_dir / "tokenizer_config.json"
    for _ in range(5):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            break
        except FileNotFoundError:
            return False
        except json.JSONDecodeError:  # another rank is writing it
            time.sleep(0.2)
    else:
        return False
    if (
        data.get("tokenizer_class") != "TokenizersBackend"
        or not (output_dir / "tokenizer.json").exists()
    ):
        return False
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return True


def _finite(value: Any) -> float | None:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def train(
    config_path: str, overrides: dict | None = None, progress_file: str | None = None
) -> dict:
    """Run axolotl's training on this rank and return a small JSON-able summary.

    Args:
        config_path: An axolotl YAML config (e.g. trainflow/presets/frameworks/axolotl-tiny.yaml).
        overrides: Values the pipeline fills in; see `apply_overrides`. Typical keys:
            ``base_model``, ``tokenizer_config``, ``dataset_path``, ``output_dir``,
            ``dataset_prepared_path``, ``max_steps``, ``micro_batch_size``, ``learning_rate``,
            ``seed``, ``sequence_len``, ``logging_steps``.
        progress_file: Where rank 0 writes its progress each step (through our plugin,
            `trainflow.frameworks.progress`); every rank also records heartbeats.

    Returns:
        The same summary on every rank (the trainer all-reduces the logged loss):
        ``output_dir`` (absolute; model weights as safetensors, config, tokenizer and
        ``axolotl_config.yaml``), ``global_step``, ``max_steps``, ``train_loss`` (last logged
        loss), ``train_loss_mean`` (the trainer's mean over the run), ``loss_history``
        (``[[step, loss], ...]``), ``train_runtime_s``, ``weights`` (weight files in
        output_dir on local rank 0, which writes them; None on other ranks), ``rank``,
        ``world_size``, ``distributed`` (what accelerate set up: type, backend, number of
        processes, device, the model's wrapper) and ``version`` (axolotl's).
    """
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))

    cfg_dict = load_config(config_path, overrides)
    if not cfg_dict.get("output_dir"):
        raise ValueError("axolotl config has no output_dir: set it in the YAML or in overrides")
    if cfg_dict.get("use_ray"):
        raise ValueError("use_ray: the ranks are already launched; drop use_ray from the config")
    output_dir = Path(cfg_dict["output_dir"]).absolute()
    cfg_dict["output_dir"] = str(output_dir)
    if not cfg_dict.get("dataset_prepared_path"):
        # axolotl's default is ./last_run_prepared in the working directory.
        cfg_dict["dataset_prepared_path"] = str(output_dir.parent / "axolotl_prepared")

    # Our plugin reports each step: heartbeats on every rank, progress on rank 0.
    cfg_dict["plugins"] = [*(cfg_dict.get("plugins") or []), progress.AXOLOTL_PLUGIN]
    progress.report_axolotl_to(progress_file)
    _default_env(cfg_dict)
    resolved = _write_resolved(cfg_dict, output_dir, rank)

    import axolotl
    from axolotl.cli.args import TrainerCliArgs
    from axolotl.cli.checks import check_accelerate_default_config, check_user_token
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets, load_preference_datasets
    from axolotl.train import train as axolotl_train

    # What `axolotl.cli.train.do_cli` + `do_train` do, minus parsing sys.argv.
    cfg = load_cfg(str(resolved))
    cli_args = TrainerCliArgs()
    check_accelerate_default_config()
    if local_rank == 0:
        check_user_token()

    plugin_manager = None
    dataset_meta = None
    if cfg.get("plugins"):
        from axolotl.integrations.base import PluginManager

        plugin_manager = PluginManager.get_instance()
        dataset_meta = plugin_manager.load_datasets(cfg, preprocess=False)
    if dataset_meta is None:
        if cfg.rl:
            dataset_meta = load_preference_datasets(cfg=cfg, cli_args=cli_args)
        else:
            dataset_meta = load_datasets(cfg=cfg, cli_args=cli_args)

    model, tokenizer, trainer = axolotl_train(cfg=cfg, dataset_meta=dataset_meta)

    state = trainer.state
    acc_state = trainer.accelerator.state
    distributed = {
        "type": str(getattr(acc_state.distributed_type, "value", acc_state.distributed_type)),
        "backend": getattr(acc_state, "backend", None),
        "num_processes": int(acc_state.num_processes),
        "device": str(acc_state.device),
        "model_wrapper": type(trainer.model_wrapped).__name__,
    }
    history = [
        [int(entry.get("step", 0)), float(entry["loss"])]
        for entry in state.log_history
        if _finite(entry.get("loss")) is not None
    ]
    summary: dict[str, Any] = next(
        (e for e in reversed(state.log_history) if "train_runtime" in e), {}
    )
    result = {
        "framework": "axolotl",
        "version": getattr(axolotl, "__version__", None),
        "rank": rank,
        "world_size": world_size,
        "distributed": distributed,
        "output_dir": str(output_dir),
        "config": str(resolved),
        "global_step": int(state.global_step),
        "max_steps": int(state.max_steps),
        "train_loss": history[-1][1] if history else None,
        "train_loss_mean": _finite(summary.get("train_loss")),
        "loss_history": history,
        "train_runtime_s": _finite(summary.get("train_runtime")),
        # local rank 0 writes the weights (each node's, on its own disk): list them there.
        "weights": sorted(
            p.name
            for p in output_dir.glob("*")
            if p.suffix in {".safetensors", ".bin"} or p.name.endswith(".safetensors.index.json")
        )
        if local_rank == 0
        else None,
    }

    _tokenizer_config_for_older_transformers(output_dir)
    del model, tokenizer, trainer
    if plugin_manager is not None:
        plugin_manager.post_train_unload(cfg)
    return result
