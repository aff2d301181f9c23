"""Typed configs of the techniques: one model per technique, a discriminated union on `name`.

Everything that can be checked without starting a process is checked here, so a bad config
fails when it is parsed (command line, Prefect form, deployment), not on a rank. The configs
stay free of torch so the orchestrator (and, later, Hugging Face TRL/accelerate) can read them
cheaply: `deepspeed_json` turns a `DeepSpeedConfig` into DeepSpeed's own JSON dict.

Each technique also says which frameworks can run it (`framework_problem`): "torch" (our own
loop, `Strategy.wrap`), "hf" (the Hugging Face Trainer through accelerate) and "lightning" (the
Lightning Trainer). `check_framework` turns a refusal into a `FrameworkError` before launch.
And each says what it keeps per GPU (`memory_per_gpu`, for `trainflow.memory`).

The three are registered here (`trainflow.strategies.technique`); `TechniqueConfig` is the
union of every technique registered when it is read.
"""

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainflow.strategies.footprint import Precision, Replica, States
from trainflow.strategies.technique import (
    FRAMEWORKS,
    UNION_DESCRIPTION,
    Technique,
    check_framework,
    register_technique,
    technique_union,
)

__all__ = [
    "FRAMEWORKS",
    "DDPConfig",
    "DeepSpeedConfig",
    "FSDPConfig",
    "OptimizerConfig",
    "Precision",
    "Technique",
    "TechniqueConfig",
    "check_framework",
    "deepspeed_json",
]


# Adam refuses a beta outside [0, 1) only once a rank builds the optimizer.
Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimizerConfig(BaseModel):
    """AdamW, the optimizer every technique builds for the wrapped model."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    learning_rate: float = Field(default=1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[Beta, Beta] = Field(
        default=(0.9, 0.999), description="AdamW beta1 and beta2, each in [0, 1)."
    )
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")


class DDPConfig(Technique):
    """DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets."""

    name: Literal["ddp"] = Field(default="ddp", description="Technique name.")
    bucket_cap_mb: float = Field(
        default=25.0, gt=0, description="Gradient bucket size in MiB for the all-reduce."
    )
    find_unused_parameters: bool = Field(
        default=False, description="Allow parameters that get no gradient in a step (slower)."
    )

    def memory_per_gpu(self, replica: Replica) -> States:
        """A whole replica, plus the all-reduce buckets (4 bytes per trained parameter)."""
        return replace(replica.states(), buffers=replica.trained * 4)


class FSDPConfig(Technique):
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over ranks.

    Field names follow accelerate's FSDP2 plugin (`reshard_after_forward`,
    `activation_checkpointing`, `cpu_offload`), so the same config can drive a Trainer.
    """

    precision_option: ClassVar[str | None] = "mixed_precision"
    checkpointing_option: ClassVar[str | None] = "activation_checkpointing"
    keeps_master_weights: ClassVar[bool] = True  # the fp32 shards

    name: Literal["fsdp"] = Field(default="fsdp", description="Technique name.")
    reshard_after_forward: bool = Field(
        default=True,
        description="Free gathered parameters after forward (ZeRO-3-like, less memory); "
        "False keeps them until backward (ZeRO-2-like, less communication).",
    )
    mixed_precision: Precision = Field(
        default="fp32",
        description="bf16 computes in bfloat16 and reduces gradients in float32 (GPU); "
        "fp32 keeps everything in float32.",
    )
    activation_checkpointing: bool = Field(
        default=False, description="Recompute each block's activations in backward to save memory."
    )
    cpu_offload: bool = Field(
        default=False,
        description="Keep sharded parameters, gradients and optimizer state in CPU RAM.",
    )
    replicate_degree: int = Field(
        default=1,
        ge=1,
        description="Replica groups (HSDP): shard within groups of world_size/replicate_degree "
        "ranks and replicate across groups; 1 shards over all ranks.",
    )

    def memory_per_gpu(self, replica: Replica) -> States:
        """Everything divided by the world size, plus the gathered units (the whole model
        without resharding); offloaded states go to host RAM."""
        w, whole = replica.world_size, replica.states()
        params, grads, optimizer = whole.params / w, whole.grads / w, whole.optimizer / w
        buffers = replica.layer_units if self.reshard_after_forward else replica.whole_model
        if self.cpu_offload:
            return States(0.0, 0.0, 0.0, buffers, host=params + grads + optimizer)
        return States(params, grads, optimizer, buffers)

    def check_world_size(self, world_size: int) -> None:
        """Raise if the ranks cannot be split into `replicate_degree` equal groups."""
        if world_size % self.replicate_degree:
            raise ValueError(
                f"technique.replicate_degree={self.replicate_degree} does not divide the "
                f"world size {world_size}: FSDP needs equal shard groups"
            )

    def _framework_problem(self, framework: str, device_type: str | None) -> str | None:
        if framework == "hf" and self.replicate_degree != 1:
            return "accelerate's FSDP shards over all ranks; use replicate_degree=1"
        if framework == "lightning" and self.cpu_offload:
            # ModelParallelStrategy (Lightning's FSDP2) moves the module to the rank's device
            # after configure_model; FSDP2 refuses offloaded parameters off the CPU.
            return (
                "Lightning's ModelParallelStrategy moves the sharded model to the GPU, which "
                "FSDP2's CPU offload forbids; use cpu_offload=false"
            )
        return None


class DeepSpeedConfig(Technique):
    """DeepSpeed ZeRO: stage 1 shards optimizer state, 2 adds gradients, 3 adds parameters."""

    precision_option: ClassVar[str | None] = "mixed_precision"
    keeps_master_weights: ClassVar[bool] = True  # fp32 copies in its optimizer

    name: Literal["deepspeed"] = Field(default="deepspeed", description="Technique name.")
    zero_stage: Literal[1, 2, 3] = Field(default=2, description="ZeRO stage: 1, 2 or 3.")
    offload_optimizer: bool = Field(
        default=False, description="Keep optimizer state (and its step) in CPU RAM (ZeRO-Offload)."
    )
    offload_param: bool = Field(
        default=False, description="Keep parameters in CPU RAM between uses (ZeRO-3 only)."
    )
    mixed_precision: Precision = Field(
        default="fp32",
        description="bf16 trains with bfloat16 weights and fp32 master weights (GPU).",
    )
    config_file: str | None = Field(
        default=None,
        description="A DeepSpeed JSON file used as-is instead of the options above; "
        'batch sizes that are missing or "auto" are filled in from the workload.',
    )

    @model_validator(mode="after")
    def _check(self) -> "DeepSpeedConfig":
        if self.offload_param and self.zero_stage != 3:
            raise ValueError(
                f"technique.offload_param needs zero_stage=3 (got zero_stage={self.zero_stage}): "
                "only ZeRO-3 partitions parameters"
            )
        if self.config_file is not None:
            typed = sorted(self.model_fields_set - {"name", "config_file"})
            if typed:
                raise ValueError(
                    f"technique.config_file replaces the typed options; remove {', '.join(typed)} "
                    "or drop config_file"
                )
            _read_json_object(self.config_file)
        return self

    def memory_per_gpu(self, replica: Replica) -> States:
        """ZeRO-1 divides the optimizer states by the world size, 2 also the grads, 3 also the
        params (and gathers units); bf16 keeps 16-bit params and grads beside fp32 master
        weights and moments (2 + 2 + 12 bytes)."""
        w, stage = replica.world_size, self.zero_stage
        whole = replica.states(2, 2, 12) if replica.precision == "bf16" else replica.states()
        params, grads, optimizer = whole.params, whole.grads, whole.optimizer / w
        buffers, host = 0.0, 0.0
        if stage >= 2:
            grads /= w
        if stage == 3:
            params /= w
            buffers = replica.layer_units
        if self.offload_optimizer:
            host += optimizer
            optimizer = 0.0
        if self.offload_param:
            host += params
            params = 0.0
        return States(params, grads, optimizer, buffers, host)

    def _framework_problem(self, framework: str, device_type: str | None) -> str | None:
        if framework == "lightning" and device_type not in (None, "cuda"):
            return f"Lightning's DeepSpeedStrategy runs on CUDA GPUs only, not on {device_type}"
        return None


register_technique(DDPConfig, "trainflow.strategies.ddp:DDPStrategy")
register_technique(FSDPConfig, "trainflow.strategies.fsdp:FSDPStrategy")
register_technique(DeepSpeedConfig, "trainflow.strategies.deepspeed:DeepSpeedStrategy")

if TYPE_CHECKING:
    TechniqueConfig = Annotated[
        DDPConfig | FSDPConfig | DeepSpeedConfig,
        Field(discriminator="name", description=UNION_DESCRIPTION),
    ]
else:

    def __getattr__(name: str) -> Any:
        # Read at each import: the union of the techniques registered by then.
        if name == "TechniqueConfig":
            return technique_union()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _read_json_object(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"technique.config_file {path!r} does not exist")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"technique.config_file {path!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"technique.config_file {path!r} must hold a JSON object")
    return data


# DeepSpeed's default, said explicitly: the Hugging Face Trainer casts float inputs to fp16
# unless the JSON has bf16 on or fp16 off.
_FP16_OFF = {"enabled": False}


def deepspeed_json(
    config: DeepSpeedConfig,
    *,
    micro_batch_size: int,
    grad_accum_steps: int,
    world_size: int,
    optimizer: OptimizerConfig,
    device_type: str,
) -> dict[str, Any]:
    """Build DeepSpeed's JSON config from the typed config (or complete the user's file).

    Args:
        config: The technique config.
        micro_batch_size: Samples per rank per micro-batch.
        grad_accum_steps: Micro-batches per optimizer step.
        world_size: Number of ranks (data-parallel degree).
        optimizer: AdamW settings, used unless the user's file names an optimizer.
        device_type: "cuda" uses DeepSpeed's fused Adam; anything else uses torch's AdamW
            (`"torch_adam": true`), which needs no compiled ops.

    Returns:
        The dict to pass as `deepspeed.initialize(config=...)`.

    Raises:
        ValueError: the user's file sets a batch size that disagrees with the workload.
    """
    batch = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": micro_batch_size * grad_accum_steps * world_size,
    }
    torch_adam = device_type != "cuda"
    adamw = {
        "type": "AdamW",
        "params": {
            "lr": optimizer.learning_rate,
            "betas": list(optimizer.betas),
            "eps": optimizer.eps,
            "weight_decay": optimizer.weight_decay,
            "torch_adam": torch_adam,
        },
    }
    if config.config_file is not None:
        ds = _read_json_object(config.config_file)
        for key, value in batch.items():
            if ds.get(key, "auto") not in ("auto", value):
                raise ValueError(
                    f"technique.config_file sets {key}={ds[key]!r} but the workload needs "
                    f'{value}: remove it or set it to "auto"'
                )
            ds[key] = value
        ds.setdefault("optimizer", adamw)
        if torch_adam:
            ds["optimizer"].setdefault("params", {}).setdefault("torch_adam", True)
        ds.setdefault("zero_optimization", {}).setdefault(
            "stage3_gather_16bit_weights_on_model_save", True
        )
        ds.setdefault("fp16", dict(_FP16_OFF))
        return ds
    zero: dict[str, Any] = {
        "stage": config.zero_stage,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    if config.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device_type == "cuda"}
    if config.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": device_type == "cuda"}
    return {
        **batch,
        "optimizer": adamw,
        "zero_optimization": zero,
        "bf16": {"enabled": config.mixed_precision == "bf16"},
        "fp16": dict(_FP16_OFF),
        # Offloading with torch's AdamW instead of DeepSpeed's compiled CPU Adam.
        "zero_force_ds_cpu_optimizer": not torch_adam,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
