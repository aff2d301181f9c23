"""Mosaic LLM Foundry on one rank: read a foundry YAML, apply overrides, run foundry's trainer.

Runs in `.venvs/llm-foundry` (`bash scripts/setup-framework.sh llm-foundry`): LLM Foundry 0.22
pins torch 2.7.0 and transformers 4.51, which the main environment cannot share. Every rank
calls `train`; torch elastic has set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and NODE_RANK/GROUP_RANK, and Composer builds its process group from
them (gloo when CUDA is hidden, NCCL on GPUs). Composer also needs NODE_RANK, which torch
elastic does not set: `train` takes it from GROUP_RANK when it is missing.

Only the standard library is imported here: llmfoundry, composer and omegaconf are imported
inside `train`, so this module imports in the main environment too.

Overrides (all optional; the pipeline fills them in):

    model_path    local folder or Hub id of the Hugging Face model -> variables.model_path
    data_path     MDS dataset root holding <split>/index.json; a local path -> variables.data_local,
                  a URI (s3://...) -> variables.data_remote with a local cache directory
    save_folder   where checkpoints go -> variables.save_folder
    max_seq_len   longest sample in tokens -> variables.max_seq_len
    tokenizer_path  a tokenizer other than the model's -> tokenizer.name
    max_duration  an int is a number of batches ("8ba"); a string is passed as is ("1ep")
    any other key a config path, dotted ("optimizer.lr") or top-level ("global_train_batch_size"),
                  whose value (a dict merges into the section) is merged with OmegaConf

Those mapped to `variables.*` need the YAML to declare the variable (foundry's own `variables:`
convention), so a YAML that would ignore them fails instead of silently training on something
else. `pipeline_overrides` builds them from what our pipeline owns.

Data: foundry's `finetuning` dataloader reads an MDS split through `streams` (or `remote`); a
sample is one of: `input_ids` (the prompt's token ids) + `labels` (the answer's token ids,
ending with EOS), ndarray or bytes columns, one turn; `turns` (json: a list of such
{input_ids, labels} pairs, one per assistant turn); `prompt` + `response` (or `completion`)
strings; or `messages` (json chat), the last two tokenized by foundry. A local split whose
columns fit none of these is refused before training, naming its columns.
"""

import hashlib
import math
import os
import tempfile
import time
from typing import Any

from trainflow.frameworks import progress

# Override shorthands that set the YAML's `variables:` entry of the same name.
_VARIABLES = ("model_path", "save_folder", "max_seq_len")
# Column sets foundry's `finetuning` and `text` dataloaders read from MDS (one must be present).
_FINETUNING_COLUMNS = (
    {"input_ids", "labels"},
    {"turns"},
    {"prompt", "response"},
    {"prompt", "completion"},
    {"messages"},
)
_TEXT_COLUMNS = ({"tokens"}, {"text"})


def pipeline_overrides(
    *,
    base_model: str,
    tokenizer: str | None,
    data: str,
    output_dir: str,
    max_steps: int | None,
    max_length: int | None,
) -> dict[str, Any]:
    """The overrides our pipeline gives `train`: what it owns in the foundry YAML.

    The base model (a Hub id or a folder), its tokenizer when it is another one, the prepared
    MDS dataset root (`<split>/index.json`), the output folder, and the number of batches and
    the sequence length when given.
    """
    overrides: dict[str, Any] = {
        "model_path": base_model,
        "data_path": data,
        "save_folder": output_dir,
    }
    if tokenizer and tokenizer != base_model:
        overrides["tokenizer_path"] = tokenizer
    if max_steps is not None:
        overrides["max_duration"] = int(max_steps)
    if max_length is not None:
        overrides["max_seq_len"] = int(max_length)
    return overrides


def _data_variables(data_path: str) -> dict[str, Any]:
    """`variables.data_local`/`data_remote` for an MDS dataset at a local path or a URI."""
    if "://" not in data_path:
        return {"data_local": os.path.abspath(data_path), "data_remote": None}
    # Every rank of a node must use the same local cache for one remote dataset.
    digest = hashlib.sha256(data_path.encode()).hexdigest()[:16]
    cache = os.path.join(tempfile.gettempdir(), f"llm-foundry-mds-{digest}")
    return {"data_local": cache, "data_remote": data_path}


def _patch(cfg: Any, overrides: dict[str, Any]) -> Any:
    """The overrides as one OmegaConf config to merge over `cfg` (checked against it)."""
    from omegaconf import OmegaConf

    patch = OmegaConf.create({})
    variables = cfg.get("variables") or {}
    for key, value in overrides.items():
        if key in _VARIABLES or key == "data_path":
            names = _data_variables(str(value)) if key == "data_path" else {key: value}
            missing = [name for name in names if name not in variables]
            if missing:
                raise ValueError(
                    f"override {key!r} needs the YAML to declare variables.{missing[0]} "
                    f"(and use it); it declares {sorted(variables)}"
                )
            for name, item in names.items():
                if key != "data_path" and "://" not in str(item) and os.path.exists(str(item)):
                    item = os.path.abspath(item)  # a local folder, not a Hub id
                OmegaConf.update(patch, f"variables.{name}", item, merge=True)
        elif key == "tokenizer_path":
            local = "://" not in str(value) and os.path.exists(str(value))
            OmegaConf.update(patch, "tokenizer.name", os.path.abspath(value) if local else value)
        elif key == "max_duration":
            if isinstance(value, bool) or not isinstance(value, int | str):
                raise ValueError(f"max_duration must be a batch count or a string, not {value!r}")
            duration = f"{value}ba" if isinstance(value, int) else value
            OmegaConf.update(patch, "max_duration", duration)
        else:
            OmegaConf.update(patch, key, value, merge=True)
    return patch


def _hf_checkpointer(trainer: Any) -> Any:
    from llmfoundry.callbacks import HuggingFaceCheckpointer

    found = [c for c in trainer.state.callbacks if isinstance(c, HuggingFaceCheckpointer)]
    return found[0] if found else None


def _final_hf_dir(trainer: Any) -> str | None:
    """Where foundry's `hf_checkpointer` wrote the model at the end of training, or None."""
    from composer.utils import format_name_with_dist_and_time

    callback = _hf_checkpointer(trainer)
    if callback is None:
        return None
    # The path the callback's final save used (`_save_checkpoint`): <save_folder>/huggingface/ba<N>
    save_dir = format_name_with_dist_and_time(
        os.path.join(callback.save_dir_format_str, callback.huggingface_folder_name_fstr),
        trainer.state.run_name,
        trainer.state.timestamp,
    )
    if callback.remote_ud is not None:  # an object store: the URI the callback uploaded to
        return callback.remote_ud.remote_backend.get_uri(save_dir)
    return os.path.abspath(save_dir)


def _loss(trainer: Any) -> tuple[float | None, float | None]:
    """(the last batch's train loss as Composer logged it: mean over ranks, this rank's own)."""
    logged = getattr(trainer.state, "total_loss_dict", None) or {}
    mean = logged.get("loss/train/total")
    own = trainer.state.loss
    if isinstance(own, dict):
        own = own.get("total", sum(own.values()))
    if isinstance(own, list | tuple):
        own = sum(own)
    values: list[float | None] = []
    for raw in (mean, own):
        value: float | None
        try:
            value = float(raw) if raw is not None else None
        except (TypeError, ValueError):
            value = None
        values.append(value if value is not None and math.isfinite(value) else None)
    return values[0], values[1]


def _check_columns(cfg: Any) -> None:
    """Refuse a local MDS split whose columns foundry's train dataloader cannot read."""
    import json

    from omegaconf import OmegaConf

    loader = OmegaConf.select(cfg, "train_loader", default=None) or {}
    name = loader.get("name")
    by_loader = {"finetuning": _FINETUNING_COLUMNS, "text": _TEXT_COLUMNS}
    accepted = by_loader.get(name) if name is not None else None
    dataset = loader.get("dataset") or {}
    sources = list((dataset.get("streams") or {}).values()) or [dataset]
    for source in sources:
        local, split = source.get("local"), source.get("split") or dataset.get("split")
        if accepted is None or source.get("remote") or not local or not split:
            continue
        index = os.path.join(local, split, "index.json")
        if not os.path.isfile(index):
            continue  # foundry names the missing split itself
        with open(index, encoding="utf-8") as f:
            shards = json.load(f).get("shards") or [{}]
        columns = set(shards[0].get("column_names") or [])
        if not any(need <= columns for need in accepted):
            wanted = " or ".join("+".join(sorted(need)) for need in accepted)
            raise ValueError(
                f"{os.path.join(local, split)} has columns {sorted(columns)}; foundry's "
                f"{loader.get('name')!r} dataloader reads {wanted}"
            )


def _loss_history(trainer: Any) -> list[list[float]]:
    """[[batch, loss], ...] from the in-memory logger `train` adds: Composer's logged loss."""
    from composer.loggers import InMemoryLogger

    for destination in trainer.logger.destinations:
        if isinstance(destination, InMemoryLogger):
            points = destination.data.get("loss/train/total", [])
            # Logged before the batch counter moves on: batch 1's loss carries batch=0.
            return [[int(ts.batch) + 1, float(value)] for ts, value in points]
    return []


def train(
    config_path: str, overrides: dict[str, Any] | None = None, progress_file: str | None = None
) -> dict[str, Any]:
    """Run LLM Foundry's training on this rank, configured by a foundry YAML plus `overrides`.

    The YAML is loaded as foundry's `train_from_yaml` loads it (OmegaConf, `oc.env` resolver
    cleared), `overrides` are merged over it (see the module doc for the keys), and
    `llmfoundry.command_utils.train` runs it: Composer initialises the process group from the
    launcher's environment, trains, and the YAML's `hf_checkpointer` callback writes the final
    Hugging Face model.

    Args:
        config_path: Path of the foundry YAML.
        overrides: Values to set over it (model_path, data_path, save_folder, max_duration, or
            any config path).
        progress_file: Where rank 0 writes its progress each batch (a Composer callback,
            `trainflow.frameworks.progress`); every rank also records heartbeats.

    Returns:
        JSON-able facts of the run on this rank: `hf_model_dir` = `model_dir` (the final
        Hugging Face model, None without an `hf_checkpointer`), `output_dir`
        (variables.save_folder), `save_folder` (Composer checkpoints, or None), `loss` =
        `train_loss` (the last batch's train loss as Composer logs it: the mean over ranks),
        `rank_loss` (this rank's own), `loss_history` ([[batch, loss], ...]), `batches` =
        `global_step`, `samples`, `tokens`, `train_runtime_s`, `rank`, `world_size`, `backend`
        (gloo on CPU), `run_name`, `version` (llmfoundry's).

    Raises:
        ValueError: An override the YAML cannot take, or local MDS data whose columns foundry's
            dataloader cannot read.
    """
    import llmfoundry
    import torch.distributed as dist
    from composer.utils import format_name_with_dist
    from llmfoundry.command_utils import train as foundry_train
    from omegaconf import DictConfig, OmegaConf

    # Composer reads NODE_RANK; torch elastic (torchrun, elastic_launch) sets only GROUP_RANK.
    if "NODE_RANK" not in os.environ and "GROUP_RANK" in os.environ:
        os.environ["NODE_RANK"] = os.environ["GROUP_RANK"]
    had_group = dist.is_available() and dist.is_initialized()
    OmegaConf.clear_resolver("oc.env")  # as foundry's train_from_yaml does
    cfg = OmegaConf.load(config_path)
    if not isinstance(cfg, DictConfig):
        raise ValueError(f"{config_path} is not a mapping of foundry's train options")
    cfg = OmegaConf.merge(cfg, _patch(cfg, dict(overrides or {})))
    assert isinstance(cfg, DictConfig)
    if OmegaConf.select(cfg, "loggers.inmemory", default=None) is None:
        OmegaConf.update(cfg, "loggers.inmemory", {}, merge=True)  # for the loss history
    reporter = {"progress_file": progress_file}
    OmegaConf.update(cfg, f"callbacks.{progress.foundry_callback()}", reporter, merge=True)
    _check_columns(cfg)

    started = time.monotonic()
    trainer = foundry_train(cfg)
    runtime_s = time.monotonic() - started
    try:
        loss, rank_loss = _loss(trainer)
        timestamp = trainer.state.timestamp
        save_folder = OmegaConf.select(cfg, "save_folder")  # Composer formats {run_name}
        if save_folder:
            save_folder = format_name_with_dist(save_folder, trainer.state.run_name)
            if "://" not in save_folder:
                save_folder = os.path.abspath(save_folder)
        hf_model_dir = _final_hf_dir(trainer)
        result = {
            "hf_model_dir": hf_model_dir,
            "model_dir": hf_model_dir,
            "output_dir": OmegaConf.select(cfg, "variables.save_folder", default=None),
            "save_folder": save_folder,
            "loss": loss,
            "train_loss": loss,
            "rank_loss": rank_loss,
            "loss_history": _loss_history(trainer),
            "batches": int(timestamp.batch),
            "global_step": int(timestamp.batch),
            "train_runtime_s": runtime_s,
            "samples": int(timestamp.sample),
            "tokens": int(timestamp.token),
            "rank": dist.get_rank() if dist.is_initialized() else 0,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "run_name": trainer.state.run_name,
            "version": llmfoundry.__version__,
        }
        if dist.is_initialized():
            dist.barrier()  # every rank's checkpoint written before any rank returns
    finally:
        trainer.close()
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()  # Composer's group; a launcher's own is left to it
    return result
