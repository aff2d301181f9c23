"""Supervised fine-tuning of a causal LM with TRL's `SFTTrainer`, under any technique.

`train` runs on every rank inside the process group the technique subflow opened. The
strategy expresses the technique to the Trainer (`Strategy.hf_trainer_args`): DDP options,
FSDP2 through accelerate's plugin, or DeepSpeed's JSON. The Trainer, not our loop, wraps the
model; `TrainResult.wrapped_as` says what it became.

Data: each rank streams only its own partition of the train split (`streaming` partitions by
the launcher's ranks), once per epoch, and the Trainer reads that loader as it is: nothing
gathers the split, and nothing shards it a second time.
"""

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
from transformers import PreTrainedModel, TrainerCallback

from trainflow import runtime
from trainflow.compat.transformers import write_checkpoints_in_background
from trainflow.configs.sft import (
    PRESETS_DIR,
    SHIPPED_TOKENIZER,
    EvaluationSettings,
    LoraSettings,
    SFTConfig,
    SFTJob,
    TrainingSettings,
    is_tiny,
    load_sft_preset,
    sft_preset_names,
    tiny_twin,
)
from trainflow.configs.sft import sft_gate_failures as gate_failures
from trainflow.data.tokenizer import load_tokenizer
from trainflow.efficiency import EfficiencyMeter, batch_work, matmul_params, training_flops
from trainflow.models.causal_lm import build_causal_lm
from trainflow.strategies import Strategy, TechniqueConfig, build_strategy
from trainflow.strategies.base import gather_full_state_dict
from trainflow.strategies.job import RankEvaluation, TrainResult, local_path
from trainflow.tracking import (
    PROGRESS_FILE,
    SINK_IMPORTS,
    MetricsSink,
    ProgressFile,
    log_transformers_model,
    metrics_sink,
    register_logged_model,
    registrable_as_is,
)
from trainflow.workloads import Evaluation
from trainflow.workloads.sft_checkpoints import BackgroundSaves, DurableCallback, read_data_state
from trainflow.workloads.sft_checks import check_ahead, check_config

__all__ = [
    "PRESETS_DIR",
    "SHIPPED_TOKENIZER",
    "EvaluationSettings",
    "LoraSettings",
    "SFTConfig",
    "SFTJob",
    "TrainingSettings",
    "build_model",
    "check_ahead",
    "check_config",
    "evaluate",
    "gate_failures",
    "load_sft_preset",
    "log_model",
    "sft_preset_names",
    "tiny_twin",
    "train",
]


# Imported by a rank only once it trains, so the flow's process (which imports this module for
# its checks and evaluation) does not pay for them; a launch's standby agent imports them
# ahead (`trainflow.launch.agent`), once, for ranks forked from it. DeepSpeed only for its own
# technique (`sft_startup.start_agent`): other ranks never import it
# (`compat.transformers.unwrap_without_deepspeed`).
RANK_IMPORTS = ("trl.trainer.sft_trainer", "trainflow.data.loader", *SINK_IMPORTS)
# Run by that agent while it waits for its launch: rank 0 logs the model after training.
RANK_WARMUPS = ("trainflow.tracking:warm_model_logging",)


def build_model(job: SFTJob) -> PreTrainedModel:
    """The architecture without pretrained weights (the subflow checks the technique on it)."""
    tokenizer = load_tokenizer(job.config.tokenizer_path())
    return build_causal_lm(job.config.model, tokenizer, seed=0, pretrained=False)


def read_split(uri: str, split: str, limit: int | None = None) -> dict[str, list[list[int]]]:
    """A prepared split, whole, in id order: `input_ids` and `assistant_masks` lists.

    For evaluation in the orchestrating process (one reader, no process group); training
    ranks stream their own partitions instead (`train_loader`), and gather a split with
    `gather_split`.

    Args:
        uri: Published dataset (`PreparedDataset.uri`).
        split: Split name, e.g. 'validation'.
        limit: Keep the first `limit` rows by id.
    """
    return _in_id_order(_split_rows(uri, split), limit)


def gather_split(uri: str, split: str, limit: int | None = None) -> dict[str, list[list[int]]]:
    """`read_split` for ranks: each reads its own partition (the dataset is partitioned by the
    launcher's ranks) and rank 0 receives them all; other ranks get an empty split. Every
    rank must call it, together."""
    import torch.distributed as dist

    rows = _split_rows(uri, split)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return _in_id_order(rows, limit)
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rows, parts, dst=0)
    if parts is None:
        return {"input_ids": [], "assistant_masks": []}
    # A partition may repeat a row to even out the ranks' shares: keyed by id, it counts once.
    return _in_id_order({i: row for part in parts for i, row in part.items()}, limit)


def _split_rows(uri: str, split: str) -> dict[int, tuple[list[int], list[int]]]:
    from trainflow.data import read_whole_split

    return {
        int(s["id"]): (s["input_ids"].tolist(), s["assistant_masks"].tolist())
        for s in read_whole_split(uri, split)
    }


def _in_id_order(
    rows: dict[int, tuple[list[int], list[int]]], limit: int | None
) -> dict[str, list[list[int]]]:
    ids = sorted(rows)[:limit]
    return {
        "input_ids": [rows[i][0] for i in ids],
        "assistant_masks": [rows[i][1] for i in ids],
    }


class SampleLog:
    """Which sample ids this rank trained on, when switched on (`start`); off by default.

    An audit aid: the ids come from the batches the Trainer actually consumed.
    """

    def __init__(self) -> None:
        self.ids: list[list[int]] | None = None

    def start(self) -> None:
        """Record from now on: one list of ids per batch the Trainer draws."""
        self.ids = []

    def record(self, ids: list[int]) -> None:
        if self.ids is not None:
            self.ids.append(ids)


sample_log = SampleLog()


class LMCollate:
    """Answer-only language-modelling batches, exactly as TRL's collator builds them, with the
    sample ids aside.

    Labels are the token ids with every non-answer token set to -100 (TRL's `assistant_masks`
    rule); rows are cut at `max_length` and right-padded to the batch's longest (ids with
    `pad_token_id`, labels with -100, attention mask 0), as TRL's
    `DataCollatorForLanguageModeling` pads them; here each column is filled into one int64
    buffer per batch instead of a tensor per row (a benchmark test compares the two). The ids
    travel as `sample_ids`, which the rank's Trainer takes out before the forward pass.
    """

    def __init__(self, pad_token_id: int, max_length: int) -> None:
        self.pad_token_id = pad_token_id
        self.max_length = max_length

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        import numpy as np
        import torch

        lengths = [min(len(s["input_ids"]), self.max_length) for s in samples]
        shape = (len(samples), max(lengths))
        input_ids = np.full(shape, self.pad_token_id, dtype=np.int64)
        labels = np.full(shape, -100, dtype=np.int64)
        attention_mask = np.zeros(shape, dtype=np.int64)
        for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
            ids = sample["input_ids"][:length]
            input_ids[row, :length] = ids
            labels[row, :length] = np.where(sample["assistant_masks"][:length] == 1, ids, -100)
            attention_mask[row, :length] = 1
        return {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy(attention_mask),
            "sample_ids": torch.tensor([int(s["id"]) for s in samples]),
        }


def train_loader(job: SFTJob, pad_token_id: int, state: dict[str, Any] | None = None) -> Any:
    """This rank's loader over its own partition of the train split, reshuffled each epoch.

    `streaming` partitions the split by the launcher's ranks; no other sampler shards it again.
    `state` (a `loader.state_dict()` saved with a checkpoint) continues right after the last
    sample the checkpointed step trained on.
    """
    from trainflow.data import LoaderConfig, build_dataloader

    t = job.config.training
    config = LoaderConfig.model_validate(
        {"batch_size": t.per_device_batch_size, "shuffle": True, "seed": t.seed}
    )
    return build_dataloader(
        job.data.uri,
        "train",
        config,
        state=state,
        collate_fn=LMCollate(pad_token_id, job.config.max_length),
    )


def _on_rank(
    trainer_class: type, loader: Any, meter: EfficiencyMeter, saves: BackgroundSaves
) -> type:
    """`trainer_class` reading `loader` as it is (this rank's partition), timing its data waits
    and counting the samples and tokens of its batches in `meter`; with `saves` enabled, its
    checkpoints are copied to host memory and written by `saves`' thread.

    The Trainer would otherwise hand the loader to accelerate, which shards an iterable
    dataset a second time across the ranks.
    """

    class RankTrainer(trainer_class):  # type: ignore[misc, valid-type]
        def get_train_dataloader(self) -> Any:
            return loader

        def get_batch_samples(self, epoch_iterator: Any, *args: Any, **kwargs: Any) -> Any:
            # Only the loader's own time is a data wait: the Trainer then counts the batch's
            # labels across the ranks (a collective), which is a wait for the slowest rank.
            batches, num_items = super().get_batch_samples(
                meter.timed(epoch_iterator), *args, **kwargs
            )
            for batch in batches:
                meter.count(*batch_work(batch))
                sample_log.record(batch.pop("sample_ids").tolist())
            return batches, num_items

    if saves.enabled:
        write_checkpoints_in_background(RankTrainer, saves)
    return RankTrainer


class ProgressCallback(TrainerCallback):
    """Rank 0's view of training: batched metrics to MLflow, a progress file, timings.

    The progress file (`progress.json` in the output folder) lets the orchestrator show
    progress without any rank talking to Prefect.
    """

    def __init__(self, sink: MetricsSink, output_dir: Path, max_steps: int) -> None:
        self.sink = sink
        path = output_dir / PROGRESS_FILE if runtime.is_rank_zero() else None
        self.progress = ProgressFile(path, max_steps)
        self.history: dict[int, dict[str, float]] = {}
        self.logging_s = 0.0

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        started = time.perf_counter()
        numbers = {k: float(v) for k, v in (logs or {}).items() if isinstance(v, int | float)}
        if "loss" in numbers:  # a training log, not the end-of-training summary
            # (The Trainer's `train_*` speed figures of this process are summed up at the end.)
            metrics = {
                k: v for k, v in numbers.items() if k != "epoch" and not k.startswith("train_")
            }
            run_tokens(metrics)
            self.history[state.global_step] = metrics
            self.sink.log(state.global_step, {f"train_{k}": v for k, v in metrics.items()})
            self.progress.update(state.global_step)
        self.logging_s += time.perf_counter() - started

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Before `DurableCallback` marks the checkpoint (it comes later in the callbacks): a
        # run resumed from it logs from the next step on, so what was logged up to it must be
        # stored, or a kill now would leave a gap in the run's metrics.
        self.sink.flush()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.sink.flush()
        self.progress.update(state.global_step)


def run_tokens(metrics: dict[str, float]) -> None:
    """Make `num_tokens` the run's non-padding tokens, resumed parts included, in a training
    log's `metrics`, and `num_tokens_since_resume` those of this process alone.

    TRL's `num_tokens` counts from 0 in each process; the Trainer's `num_input_tokens_seen`
    (counted the same way: the attention mask's ones, over every rank) is in its checkpointed
    state, so a resumed run continues it.
    """
    if "num_input_tokens_seen" in metrics:
        if "num_tokens" in metrics:
            metrics["num_tokens_since_resume"] = metrics["num_tokens"]
        metrics["num_tokens"] = metrics.pop("num_input_tokens_seen")


class EfficiencyCallback(TrainerCallback):
    """Times every optimizer step in `meter`; at the end gathers the ranks' `eff_*` figures
    (`trainflow.efficiency`) and logs them from rank 0.

    The rank's Trainer (`_on_rank`) times its data waits and counts its batches in the same
    meter.
    """

    def __init__(self, meter: EfficiencyMeter, sink: MetricsSink) -> None:
        self.meter = meter
        self.sink = sink
        self.figures: dict[str, float] = {}

    # The window opens at the first batch's fetch (`meter.timed`), not at `on_train_begin`: the
    # Trainer builds its engine after that callback (DeepSpeed's initialize, the wrapping), and
    # a rank that got there first would count its wait for the others as training.
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.meter.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.figures = self.meter.report()  # every rank: it gathers the ranks' figures
        self.sink.log(state.global_step, self.figures)
        self.sink.flush()


def technique_arguments(
    technique: TechniqueConfig,
    training: TrainingSettings,
    *,
    device_type: str,
    layer_classes: list[str],
) -> dict[str, Any]:
    """Trainer settings that apply `technique`, as its strategy expresses itself to the Trainer.

    Args:
        technique: The technique config.
        training: Batch and optimizer settings (DeepSpeed's JSON repeats them).
        device_type: "cuda" or "cpu".
        layer_classes: Class names of the model's repeated blocks (FSDP wraps each).
    """
    return build_strategy(technique).hf_trainer_args(
        micro_batch_size=training.per_device_batch_size,
        grad_accum_steps=training.grad_accum_steps,
        optimizer=training.optimizer,
        layer_classes=layer_classes,
        device_type=device_type,
    )


def _save_sharded(trainer: Any, model: PreTrainedModel, peft_config: Any, path: Path) -> None:
    """Gather the sharded weights and let rank 0 save them from an unsharded replica.

    `Trainer.save_model` saves the FSDP2-wrapped model itself, whose parameters are still
    sharded tensors; rank 0 then waits on collectives the other ranks have left.
    """
    import torch.distributed as dist
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    state = gather_full_state_dict(trainer.model)  # every rank joins; rank 0 gets it all
    if runtime.is_rank_zero():
        replica = AutoModelForCausalLM.from_config(model.config)
        if peft_config is not None:
            replica = get_peft_model(replica, peft_config)
        replica.load_state_dict(state)
        replica.save_pretrained(path)
        trainer.processing_class.save_pretrained(path)
    dist.barrier()


def _layer_classes(model: PreTrainedModel) -> list[str]:
    return sorted(set(getattr(model, "_no_split_modules", None) or []))


def checkpoints_dir(output_dir: str | Path) -> Path:
    """Where the Trainer writes its `checkpoint-N` folders."""
    return Path(output_dir) / "checkpoints"


def trained_model_dir(output_dir: str | Path) -> Path:
    """Where `train` saves the trained weights (an adapter when LoRA was used)."""
    return Path(output_dir) / "model"


def initial_model_dir(output_dir: str | Path) -> Path:
    """Where `train` saves a tiny model's initial weights (the untrained baseline)."""
    return Path(output_dir) / "initial"


def efficient_loading(config: SFTConfig, device_type: str) -> bool:
    """Whether only the first rank reads the pretrained weights (accelerate's
    `cpu_ram_efficient_loading`): asked for, under fsdp, on GPUs, for a pretrained model."""
    return (
        config.cpu_ram_efficient_loading
        and config.technique.name == "fsdp"
        and device_type == "cuda"
        and not is_tiny(config.model)
    )


# What transformers and accelerate read for CPU-RAM-efficient loading (`is_fsdp_enabled`); the
# Trainer's arguments set the same values again later.
EFFICIENT_LOADING_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_SYNC_MODULE_STATES": "true",
}


def pretrained_kwargs(config: SFTConfig) -> dict[str, Any]:
    """`from_pretrained` options: the weights' dtype, and MXFP4 experts (gpt-oss) dequantized,
    since quantized weights cannot be trained or sharded."""
    import torch
    from transformers import AutoConfig

    dtype = torch.bfloat16 if config.weights_dtype() == "bf16" else torch.float32
    kwargs: dict[str, Any] = {"dtype": dtype}
    quantization = getattr(AutoConfig.from_pretrained(config.model), "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method == "mxfp4":
        from transformers.utils.quantization_config import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    return kwargs


def empty_pretrained_model(config: SFTConfig) -> PreTrainedModel:
    """The pretrained model's architecture, its parameters on the meta device (no memory, no
    weights read; buffers such as rotary frequencies are real), in `SFTConfig.weights_dtype`.

    What the ranks but the first build under `efficient_loading`: accelerate shards it and
    fills the shards from the first rank's weights by broadcast. (transformers' own path,
    `from_pretrained` on every rank, still reads the weights on each rank of a quantized
    checkpoint such as gpt-oss's MXFP4 one.)
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.bfloat16 if config.weights_dtype() == "bf16" else torch.float32
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(config.model), dtype=dtype
        )
    model.tie_weights()  # the meta parameters were made one by one: tie them again
    return model  # type: ignore[no-any-return]


def load_training_model(
    config: SFTConfig, tokenizer: Any, device_type: str, *, seed: int
) -> PreTrainedModel:
    """The model to train on this rank: a tiny one built from its config, or the pretrained
    checkpoint in `SFTConfig.weights_dtype` (read by the first rank only, with
    `efficient_loading`)."""
    if is_tiny(config.model):
        model = build_causal_lm(config.model, tokenizer, seed=seed)
        return model.bfloat16() if config.weights_dtype() == "bf16" else model
    from transformers import AutoModelForCausalLM

    if efficient_loading(config, device_type):
        os.environ.update(EFFICIENT_LOADING_ENV)
        if not runtime.is_rank_zero():
            return empty_pretrained_model(config)
    return AutoModelForCausalLM.from_pretrained(config.model, **pretrained_kwargs(config))


def precision_arguments(config: SFTConfig) -> dict[str, Any]:
    """Trainer settings beside the technique's: bf16 autocast (which fsdp and deepspeed set
    themselves from their `mixed_precision`) and gradient checkpointing."""
    args: dict[str, Any] = {}
    if config.compute_precision() == "bf16":
        args["bf16"] = True
    if config.gradient_checkpointing and config.technique.name != "fsdp":
        # (Under fsdp the technique's activation_checkpointing does it.) Non-reentrant: DDP's
        # hooks see each parameter's gradient once.
        args["gradient_checkpointing"] = True
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    return args


def _trainer_config(config: SFTConfig, strategy: Strategy, model: Any, out: Path) -> Any:
    """TRL's `SFTConfig` for this run: steps, batches, optimizer, and the technique's settings."""
    from trl import SFTConfig as TrainerConfig

    t, opt = config.training, config.training.optimizer
    technique = strategy.hf_trainer_args(
        micro_batch_size=t.per_device_batch_size,
        grad_accum_steps=t.grad_accum_steps,
        optimizer=opt,
        layer_classes=_layer_classes(model),
    )
    if efficient_loading(config, strategy.device.type):
        technique["fsdp_config"] = technique["fsdp_config"] | {
            "cpu_ram_efficient_loading": True,
            "sync_module_states": True,
        }
    return TrainerConfig(
        output_dir=str(checkpoints_dir(out)),
        max_steps=config.max_steps,
        per_device_train_batch_size=t.per_device_batch_size,
        gradient_accumulation_steps=t.grad_accum_steps,
        learning_rate=opt.learning_rate,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        adam_epsilon=opt.eps,
        warmup_steps=t.warmup_steps,
        lr_scheduler_type=t.lr_scheduler,
        logging_steps=t.logging_steps,
        save_strategy="steps" if config.checkpoint_every else "no",
        save_steps=config.checkpoint_every or 500,
        # Old checkpoints are deleted once a newer one is complete (`DurableCallback`), not
        # while it may still be written.
        save_total_limit=None,
        # The loader's own saved position says where to continue; the Trainer must not skip
        # batches of it again.
        ignore_data_skip=True,
        report_to=[],
        seed=t.seed,
        data_seed=t.seed,
        max_length=config.max_length,
        dataloader_num_workers=0,
        # Counted into the Trainer's checkpointed state: `num_tokens` is the whole run's.
        include_num_input_tokens_seen="non_padding",
        dataset_kwargs={"skip_prepare_dataset": True},
        disable_tqdm=True,
        **(technique | precision_arguments(config)),
    )


def _lora_config(config: SFTConfig) -> Any:
    """PEFT's `LoraConfig` when the run trains an adapter, else None."""
    if not config.lora:
        return None
    from peft import LoraConfig

    lora = config.lora_settings
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )


def _train_metrics(
    output: Any, callback: ProgressCallback, efficiency: EfficiencyCallback
) -> dict[str, float]:
    """`train_*` metrics (the last logged step's, the Trainer's totals, our logging time) and
    the `eff_*` figures."""
    last = callback.history[max(callback.history)] if callback.history else {}
    summary = {k: float(v) for k, v in output.metrics.items() if k.startswith("train_")}
    summary.pop("train_loss", None)  # the run's mean; the last logged loss says more
    summary["train_logging_s"] = callback.logging_s
    return {f"train_{k}": v for k, v in last.items()} | summary | efficiency.figures


def train(
    job: SFTJob,
    strategy: Strategy,
    *,
    output_dir: str,
    mlflow_run_id: str | None = None,
    resume_from: str | None = None,
) -> TrainResult:
    """Fine-tune on this rank with `SFTTrainer`; save the trained weights (rank 0 writes).

    Checkpoints are the Trainer's own (model, optimizer, scheduler, RNG streams, step) plus the
    loader's position. With a complete checkpoint under `resume_from`, training continues
    from it at the next unseen sample.

    Raises:
        Preempted: a stop was requested; the Trainer saved a checkpoint at the step reached.
    """
    from trl import SFTTrainer

    from trainflow import checkpoint
    from trainflow.errors import Preempted

    datasets.disable_progress_bars()
    config = job.config
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(config.tokenizer_path())
    resume = checkpoint.resolve(resume_from)
    loader = train_loader(
        job, tokenizer.pad_token_id, read_data_state(resume) if resume is not None else None
    )
    # The epoch opens (streaming waits for every rank of the node, then lays out their
    # partitions) and its first batches are read while the model is built and wrapped.
    loader.start_reading()
    model = load_training_model(config, tokenizer, strategy.device.type, seed=config.training.seed)
    if runtime.is_rank_zero() and is_tiny(config.model):
        model.save_pretrained(initial_model_dir(out))
        tokenizer.save_pretrained(initial_model_dir(out))
    sink = metrics_sink(mlflow_run_id, runtime.is_rank_zero())
    callback = ProgressCallback(sink, out, config.max_steps)
    # Model FLOPs per trained token: the linear layers' 6 per weight; attention's share is left
    # out (sequences differ in length and are short here).
    meter = EfficiencyMeter(strategy.device, flops_per_token=training_flops(matmul_params(model)))
    efficiency = EfficiencyCallback(meter, sink)
    peft_config = _lora_config(config)
    # SFTTrainer wants a dataset when it is built (it checks the columns and peeks at a row);
    # the rows it trains on come from this rank's loader, through `get_train_dataloader`.
    columns = datasets.Dataset.from_dict(
        {"input_ids": [[tokenizer.pad_token_id]], "labels": [[-100]]}
    )
    durable = DurableCallback(
        loader,
        config.checkpoint_every > 0,
        strategy.name,
        keep=config.keep_checkpoints,
        background=config.async_checkpoints,
    )
    trainer = _on_rank(SFTTrainer, loader, meter, durable.saves)(
        model=model,
        args=_trainer_config(config, strategy, model, out),
        train_dataset=columns,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[efficiency, callback, durable],
    )
    strategy.prepare_hf_trainer(trainer)
    if resume is not None:
        runtime.print0(f"resuming from {resume} at step {checkpoint.read_meta(resume)['step']}")
    output = trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    if durable.stopped_at is not None:
        last = checkpoint.latest_checkpoint(checkpoints_dir(out))
        saved = f"checkpoint {last}" if last is not None else "no checkpoint"
        runtime.print0(f"stop requested: stopped after step {durable.stopped_at}; {saved}")
        raise Preempted(
            f"rank {runtime.get_global_rank()} stopped on request after step "
            f"{durable.stopped_at} ({saved})"
        )
    wrapped_as = type(trainer.model_wrapped).__name__
    runtime.print0(f"trained as {wrapped_as} on {runtime.get_world_size()} rank(s)")
    saving = time.monotonic()
    if trainer.is_fsdp_enabled:
        _save_sharded(trainer, model, peft_config, trained_model_dir(out))
    else:
        trainer.save_model(str(trained_model_dir(out)))
    took = time.monotonic() - saving
    runtime.print0(f"saved the trained model to {trained_model_dir(out)} in {took:.1f}s")
    result = TrainResult(
        technique=strategy.name,
        world_size=runtime.get_world_size(),
        wrapped_as=wrapped_as,
        steps=output.global_step,
        metrics=_train_metrics(output, callback, efficiency),
        history=callback.history,
        checkpoint_uri=checkpoint.uri(checkpoint.latest_checkpoint(checkpoints_dir(out))),
        model_uri=trained_model_dir(out).resolve().as_uri(),
    )
    if job.evaluate_on_ranks and mlflow_run_id is not None:
        del trainer, model, loader  # the optimizer's state and the training copy go first
        _release_memory(strategy.device)
        e = config.evaluation
        held_out = gather_split(job.data.uri, "validation", e.num_samples)  # every rank reads
        if runtime.is_rank_zero():
            result.evaluation = evaluate_and_log(
                job, result, mlflow_run_id, held_out, strategy.device
            )
    return result


def _release_memory(device: Any) -> None:
    """Free the training state, and leave DeepSpeed's ZeRO-3 mode: under it, transformers
    loads a model partitioned across the ranks (a collective), which rank 0 evaluating alone
    would wait on forever."""
    import gc

    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def evaluate_and_log(
    job: SFTJob,
    trained: TrainResult,
    run_id: str,
    held_out: dict[str, list[list[int]]],
    device: Any = None,
) -> RankEvaluation:
    """On rank 0, right after training: the held-out metrics (`evaluate` on `held_out`, on
    `device`) and the trained model logged to the MLflow run (`log_model`'s model, card and
    signature), for the pipeline to register without loading it. Saying it is alive after
    each batch, for the launcher's hang watchdog."""
    step, started = trained.steps, time.monotonic()
    evaluation = evaluate(
        job, trained, device=device, on_batch=lambda: runtime.heartbeat(step), held_out=held_out
    )
    evaluated = time.monotonic()
    rows, took = len(held_out["input_ids"]), evaluated - started
    print(f"evaluated the trained and untrained models on {rows} rows in {took:.1f}s")
    tags = {"mlflow_run_id": run_id, "dataset_fingerprint": job.data.fingerprint}
    uri = _log(job, evaluation, run_id, tags)
    print(f"logged the model to MLflow run {run_id} in {time.monotonic() - evaluated:.1f}s")
    return RankEvaluation(metrics=evaluation.metrics, logged_model_uri=uri)


def load_model(config: SFTConfig, output_dir: str | Path, *, trained: bool) -> PreTrainedModel:
    """The trained model (a LoRA adapter merged into its base) or the untrained one, for
    inference: a tiny model's saved initial weights, or the pretrained checkpoint."""
    from transformers import AutoModelForCausalLM

    base = str(initial_model_dir(output_dir)) if is_tiny(config.model) else config.model
    weights = str(trained_model_dir(output_dir))
    if not trained:
        model = AutoModelForCausalLM.from_pretrained(base)
    elif config.lora:
        from peft import PeftModel

        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), weights)
        model = adapted.merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(weights)
    # TRL turns on the mixture-of-experts router loss for training; it is not part of the
    # model's output at inference (and breaks batched generation).
    if getattr(model.config, "output_router_logits", False):
        model.config.output_router_logits = False
    return model.eval()


def evaluate(
    job: SFTJob,
    trained: TrainResult,
    *,
    device: Any = None,
    on_batch: Callable[[], None] | None = None,
    held_out: dict[str, list[list[int]]] | None = None,
) -> Evaluation:
    """Held-out metrics of the trained model (`eval_*`) and of the untrained one (`untrained_*`).

    The trained model is loaded once here and kept in the result for registration, with the
    first held-out prompt as its input example, and the folder it was loaded from. Models
    are evaluated on `device` (default: where they load, the CPU), on `held_out` (default:
    the validation split, read here).
    """
    from trainflow.evaluation import trained_vs_untrained

    config, output_dir = job.config, local_path(trained.model_uri).parent
    e = config.evaluation

    def load(trained: bool) -> PreTrainedModel:
        model = load_model(config, output_dir, trained=trained)
        return model if device is None else _onto(model, device)

    metrics, model, example = trained_vs_untrained(
        lambda: load(trained=False),
        lambda: load(trained=True),
        load_tokenizer(config.tokenizer_path()),
        held_out if held_out is not None else read_split(job.data.uri, "validation", e.num_samples),
        batch_size=e.batch_size,
        max_new_tokens=e.max_new_tokens,
        on_batch=on_batch,
    )
    return Evaluation(
        metrics, model, input_example=example, model_dir=trained_model_dir(output_dir)
    )


def _onto(model: PreTrainedModel, device: Any) -> PreTrainedModel:
    """`model` on `device`; on the CPU, where it was loaded, if it does not fit the GPU."""
    import torch

    if device.type != "cuda":
        return model.to(device)
    try:
        return model.to(device)
    except torch.cuda.OutOfMemoryError:
        # transformers wraps `to` with `functools.wraps(Module.to)`; typeshed's `_Wrapped` has
        # no `__get__`, so mypy does not bind `self` and takes "cpu" for it.
        model.to("cpu")  # type: ignore[arg-type]
        torch.cuda.empty_cache()
        print(f"the model does not fit {device} for evaluation: evaluating on the CPU")
        return model


def log_model(
    job: SFTJob, evaluation: Evaluation, run_id: str, name: str, tags: dict[str, str]
) -> str:
    """Log the trained model (LoRA merged) with `mlflow.transformers` and register it: a full
    fine-tune's folder as it is, a merged adapter saved once beside it (in the run's folder)."""
    return register_logged_model(_log(job, evaluation, run_id, tags), name, tags)


def _log(job: SFTJob, evaluation: Evaluation, run_id: str, tags: dict[str, str]) -> str:
    """The evaluated model logged to the run, with its card; returns its model URI."""
    folder = evaluation.model_dir
    assert folder is not None, "sft.evaluate gives the folder the model was loaded from"
    model = evaluation.model
    return log_transformers_model(
        run_id,
        model,
        load_tokenizer(job.config.tokenizer_path()),
        evaluation.input_example,
        card=model_card(job.config, evaluation.metrics, tags),
        checkpoint=folder if registrable_as_is(folder, model) else None,
        scratch_dir=folder.parent,
    )


def model_card(config: SFTConfig, metrics: dict[str, float], tags: dict[str, str]) -> str:
    """The registered model's card: what it was fine-tuned from, on what, how, and its scores."""
    local = Path(config.model).expanduser().exists()
    base = config.model if "/" in config.model and not local else None
    header = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    header += [f"base_model: {base}"] if base else []
    header += ["tags: [trainflow, sft]", "---"]
    scores = "\n".join(f"| {k} | {v:.4f} |" for k, v in sorted(metrics.items()))
    return "\n".join(header) + (
        f"\n\n# {config.registered_model_name}\n\n"
        f"Fine-tuned from `{config.model}` on `{config.dataset}` with "
        f"{config.technique.name}{' and LoRA' if config.lora else ''} on {config.gpus} "
        f"{config.gpu_type} rank(s), {config.max_steps} steps "
        f"(MLflow run `{tags.get('mlflow_run_id', '')}`, dataset "
        f"`{tags.get('dataset_fingerprint', '')}`).\n\n"
        f"| metric | value |\n|---|---|\n{scores}\n"
    )
