"""Patches into Hugging Face transformers and accelerate: the Trainer on CPU ranks (as CPU,
FSDP as FSDP2), the check that accelerate took the launched world, and the Trainer's
checkpoint methods a rank's trainer overrides (`checkpoint_fixes`).

Written and tested for transformers 4.51 (LLM Foundry's environment) to 4.57 (trainflow's) and
5.16 (Axolotl's), accelerate 1.8 to 1.16.
"""

import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainflow.compat.adaptations import launched_world, note, single_process
from trainflow.compat.patching import check, declare, replace

TRANSFORMERS = ">=4.51,<5.17"
ACCELERATE = ">=1.8,<1.17"

TRAINING_ARGUMENTS = declare(
    "transformers: TrainingArguments.__post_init__",
    "transformers",
    TRANSFORMERS,
    target="transformers.training_args:TrainingArguments.__post_init__",
    params=("self",),
    why="CPU ranks: the Trainer runs with use_cpu=True (DDP over gloo, bf16 on the CPU)",
)
CREATE_ACCELERATOR = declare(
    "transformers: Trainer.create_accelerator_and_postprocess",
    "transformers",
    TRANSFORMERS,
    target="transformers.trainer:Trainer.create_accelerator_and_postprocess",
    params=("self",),
    why="CPU ranks: FSDP asked of the Trainer shards with FSDP2 (FSDP1 needs an accelerator)",
)
ACCELERATOR_STATE = declare(
    "accelerate: AcceleratorState.fsdp_plugin, distributed_type",
    "accelerate",
    ACCELERATE,
    target="accelerate.utils:FullyShardedDataParallelPlugin",
    params=("fsdp_version",),
    outside="refuse",
    why="CPU ranks: the FSDP plugin set on accelerate's state after the Trainer built it; "
    "set wrongly, the model trains unsharded (DDP) without a word",
)
PARTIAL_STATE = declare(
    "accelerate: PartialState.__init__",
    "accelerate",
    ACCELERATE,
    target="accelerate.state:PartialState.__init__",
    params=("self",),
    why="a Trainer that set itself up single-process inside a multi-rank launch fails, naming "
    "it, instead of training one copy per rank",
)
SAVE_MODEL = declare(
    "transformers: Trainer.save_model(_internal_call)",
    "transformers",
    TRANSFORMERS,
    target="transformers.trainer:Trainer.save_model",
    params=("output_dir", "_internal_call"),
    outside="refuse",
    why="under FSDP2, rank 0 alone reading sharded parameters for a checkpoint's weights copy "
    "waits on collectives the other ranks never join (a hang)",
)
LOAD_OPTIMIZER = declare(
    "transformers: Trainer._load_optimizer_and_scheduler",
    "transformers",
    TRANSFORMERS,
    target="transformers.trainer:Trainer._load_optimizer_and_scheduler",
    params=("checkpoint",),
    why="several CPU ranks: the Trainer maps the saved optimizer to `cpu:<rank>`, which "
    "torch.load cannot restore to",
)


def adapt_training_arguments(module: types.ModuleType) -> None:
    """On CPU ranks the Trainer runs as CPU: DDP over gloo, and bf16 allowed on the CPU."""
    arguments = module.TrainingArguments

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def __post_init__(self: Any) -> None:
            if not self.use_cpu:
                self.use_cpu = True
                note("the Hugging Face Trainer runs with use_cpu=True")
            if self.deepspeed and os.environ.pop("ACCELERATE_USE_CPU", None) is not None:
                # accelerate hands the model to DeepSpeed only when the environment does not
                # say CPU (else it wraps it in DDP, silently); use_cpu still picks gloo.
                pass
            original(self)

        return __post_init__

    replace(TRAINING_ARGUMENTS, arguments, "__post_init__", make)


def shard_with_fsdp2_on_cpu(trainer: Any) -> None:
    """Have a Hugging Face Trainer asked for FSDP shard with FSDP2 on CPU ranks.

    accelerate 1.15 turns FSDP on only for accelerator devices and otherwise wraps the model in
    DDP without a word; `fully_shard` itself works on a CPU mesh over gloo. The plugin is
    rebuilt from the `FSDP_*` environment the Trainer's arguments filled.
    """
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    check(ACCELERATOR_STATE)

    state = AcceleratorState()
    plugin = FullyShardedDataParallelPlugin()
    plugin.activation_checkpointing = trainer.args.fsdp_config.get(
        "activation_checkpointing", False
    )
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def adapt_trainer(module: types.ModuleType) -> None:
    """FSDP asked of the Trainer on CPU ranks: FSDP2 (FSDP1 needs an accelerator device)."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def create_accelerator_and_postprocess(self: Any) -> None:
            fsdp = bool(self.args.fsdp)
            if fsdp and os.environ.get("FSDP_VERSION", "1") != "2":
                os.environ["FSDP_VERSION"] = "2"
                # Sharded checkpoints: accelerate's full-state-dict load under FSDP2 has only
                # rank 0 join the broadcast.
                os.environ["FSDP_STATE_DICT_TYPE"] = "SHARDED_STATE_DICT"
                note("the Trainer's FSDP shards with FSDP2 (fully_shard) on the CPU")
            original(self)
            if fsdp:
                shard_with_fsdp2_on_cpu(self)

        return create_accelerator_and_postprocess

    replace(CREATE_ACCELERATOR, module.Trainer, "create_accelerator_and_postprocess", make)


def check_accelerate(module: types.ModuleType) -> None:
    state = module.PartialState

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            world, _ = launched_world()
            if world > 1 and self.num_processes != world:
                raise single_process(
                    "Hugging Face accelerate",
                    self.num_processes,
                    f" (distributed type {self.distributed_type})",
                )

        return __init__

    replace(PARTIAL_STATE, state, "__init__", make)


def checkpoint_fixes(trainer_class: type) -> type:
    """`trainer_class` with the two checkpoint methods a rank's Trainer needs changed.

    - `save_model` skips the plain weights copy in a checkpoint when FSDP shards the model:
      with FSDP2 the Trainer's `save_model` has rank 0 alone read parameters that are still
      sharded, which waits on collectives the other ranks never join. Every rank writes the
      checkpoint's FSDP model and optimizer state right after (`save_fsdp_model`); that is
      what a resume loads.
    - `_load_optimizer_and_scheduler` loads the optimizer state onto the CPU for CPU ranks:
      with several CPU ranks the Trainer maps the saved state to `cpu:<rank>`, a location
      `torch.load` cannot restore to.
    """
    check(SAVE_MODEL)
    check(LOAD_OPTIMIZER)

    class CheckpointFixes(trainer_class):  # type: ignore[misc, valid-type]
        def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
            if _internal_call and self.is_fsdp_enabled:
                return
            super().save_model(output_dir, _internal_call)

        def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
            plain_cpu = not (self.is_fsdp_enabled or self.is_deepspeed_enabled)
            if checkpoint is None or self.args.device.type != "cpu" or not plain_cpu:
                super()._load_optimizer_and_scheduler(checkpoint)
                return
            import torch
            from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

            folder = Path(checkpoint)
            if (folder / OPTIMIZER_NAME).is_file() and (folder / SCHEDULER_NAME).is_file():
                optimizer = torch.load(
                    folder / OPTIMIZER_NAME, map_location="cpu", weights_only=True
                )
                self.optimizer.load_state_dict(optimizer)
                scheduler = torch.load(folder / SCHEDULER_NAME, weights_only=True)
                self.lr_scheduler.load_state_dict(scheduler)

    CheckpointFixes.__name__ = CheckpointFixes.__qualname__ = trainer_class.__name__
    return CheckpointFixes
