"""Patches into Hugging Face transformers and accelerate: the Trainer on CPU ranks (as CPU,
FSDP as FSDP2) and the check that accelerate took the launched world.

Written and tested for transformers 4.51 (LLM Foundry's environment), 4.57 (Unsloth's), 5.16
(Axolotl's) and 5.22 (trainflow's), accelerate 1.8 to 1.16.

Two patches of the Trainer's checkpoint methods are gone since transformers 5.18, which
trainflow's environment requires: the optimizer state saved on several CPU ranks loads (it was
mapped to `cpu:<rank>`), and under FSDP2 `save_model` no longer has rank 0 alone read sharded
parameters (a hang). The FSDP and DDP resume tests (tests/distributed/test_rank_data.py) hold
both.
"""

import os
import sys
import types
from collections.abc import Callable
from typing import Any, Protocol

from trainflow.compat.adaptations import launched_world, note, single_process
from trainflow.compat.patching import check, declare, replace

TRANSFORMERS = ">=4.51,<5.23"
# Background checkpoints: written and tested for trainflow's own environment only.
TRANSFORMERS_CHECKPOINTS = ">=5.22,<5.23"
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
    params=("self", "cpu"),
    why="CPU ranks: a bare PartialState() takes the launch's ACCELERATE_USE_CPU as "
    "Accelerator() does (it joins the gloo world); a state that set itself up single-process "
    "inside a multi-rank launch fails, naming it, instead of training one copy per rank",
)
UNWRAP_MODEL = declare(
    "accelerate: utils.other.is_deepspeed_available (extract_model_from_parallel)",
    "accelerate",
    ACCELERATE,
    target="accelerate.utils.other:is_deepspeed_available",
    why="speed: unwrapping a model (every Trainer save) imports DeepSpeed whenever it is "
    "installed, about 0.6 s of a core, to test for a DeepSpeed engine, which only a process "
    "that imported DeepSpeed can hold",
)

SAVE_MODEL = declare(
    "transformers: Trainer.save_model (_internal_call)",
    "transformers",
    TRANSFORMERS_CHECKPOINTS,
    target="transformers.trainer:Trainer.save_model",
    params=("self", "output_dir", "_internal_call"),
    outside="refuse",
    why="background checkpoints: the weights `_save_checkpoint` saves (`_internal_call=True`) "
    "are copied to host memory and written by `Trainer._save` in a thread; a Trainer that "
    "saved them elsewhere would leave checkpoints without weights, marked complete",
)
SAVE_OPTIMIZER = declare(
    "transformers: Trainer._save_optimizer_and_scheduler",
    "transformers",
    TRANSFORMERS_CHECKPOINTS,
    target="transformers.trainer:Trainer._save_optimizer_and_scheduler",
    params=("self", "output_dir"),
    outside="refuse",
    why="background checkpoints: the optimizer and scheduler states are copied to host "
    "memory and written by a thread as `optimizer.pt` and `scheduler.pt`",
)


class BackgroundWriter(Protocol):
    """Where a Trainer's checkpoint writes go when they run in the background."""

    def wait(self) -> None:
        """Return once the checkpoint in flight, if any, is written (raise its error)."""

    def in_background(self, step: int, max_steps: int) -> bool:
        """Whether the checkpoint of `step` is written in the background."""

    def add(self, write: Callable[[], None]) -> None:
        """One write of the checkpoint being saved, to run in the background."""


def write_checkpoints_in_background(trainer_class: type, writer: BackgroundWriter) -> None:
    """Have `trainer_class` (a subclass of the Trainer, under DDP or on one process) copy its
    checkpoints' weights, optimizer and scheduler to host memory and hand their writes to
    `writer`: the same files, written by the same calls (`Trainer._save`, `torch.save`).

    Every save of a checkpoint first waits for the one in flight; a checkpoint `writer` keeps in
    the foreground (the last step's, a stop's) is written by the Trainer itself. The FSDP and
    DeepSpeed checkpoints (their engines' own sharded writes) are refused.
    """
    import torch
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

    def background(trainer: Any) -> bool:
        if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
            raise ValueError(
                "async_checkpoints: the Trainer writes FSDP and DeepSpeed checkpoints at once"
            )
        return writer.in_background(trainer.state.global_step, trainer.state.max_steps)

    def make_save_model(original: Callable[..., Any]) -> Callable[..., Any]:
        def save_model(
            self: Any, output_dir: str | None = None, _internal_call: bool = False
        ) -> None:
            if not _internal_call:
                return original(self, output_dir, _internal_call)
            writer.wait()  # one checkpoint in flight at most
            if not background(self):
                return original(self, output_dir, _internal_call)
            if self.args.should_save:
                weights = host_copy(self.model.state_dict())
                writer.add(lambda: self._save(output_dir, state_dict=weights))
            return None

        return save_model

    def make_save_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
        def _save_optimizer_and_scheduler(self: Any, output_dir: str) -> None:
            if not background(self):
                return original(self, output_dir)
            if self.args.should_save:
                optimizer = host_copy(self.optimizer.state_dict())
                scheduler = host_copy(self.lr_scheduler.state_dict())

                def write() -> None:
                    torch.save(optimizer, os.path.join(output_dir, OPTIMIZER_NAME))
                    torch.save(scheduler, os.path.join(output_dir, SCHEDULER_NAME))

                writer.add(write)
            return None

        return _save_optimizer_and_scheduler

    replace(SAVE_MODEL, trainer_class, "save_model", make_save_model)
    replace(SAVE_OPTIMIZER, trainer_class, "_save_optimizer_and_scheduler", make_save_optimizer)


def host_copy(value: Any) -> Any:
    """`value` (a state dict: tensors in dicts, lists and tuples) with every tensor copied to
    host memory and every container new, so later steps cannot change it. Tensors that share
    storage (tied weights) share their copy, as the Trainer's writer expects of them."""
    import copy

    import torch

    copies: dict[tuple[Any, ...], torch.Tensor] = {}

    def copied(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), v.shape, v.stride(), v.dtype)
            if key not in copies:
                copies[key] = v.detach().to("cpu", copy=True)
            return copies[key]
        if isinstance(v, dict):
            return {k: copied(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return type(v)(copied(x) for x in v)
        return copy.deepcopy(v)

    return copied(value)


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

    accelerate 1.15 and 1.16 turn FSDP on only for accelerator devices and otherwise wrap the
    model in DDP without a word; `fully_shard` itself works on a CPU mesh over gloo. The plugin
    is rebuilt from the Trainer's own settings (`TrainingArguments.fsdp_plugin_args` in
    transformers 5, the `FSDP_*` environment in 4).
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    check(ACCELERATOR_STATE)

    state = AcceleratorState()
    settings = getattr(trainer.args, "fsdp_plugin_args", None)
    if settings:
        # transformers 5: the plugin settings the Trainer would give accelerate (wrap policy,
        # layer classes, activation checkpointing, state dict type, resharding).
        plugin = FullyShardedDataParallelPlugin(**{**settings, "fsdp_version": 2})
    else:
        # transformers 4 filled the `FSDP_*` environment the plugin reads.
        plugin = FullyShardedDataParallelPlugin()
        plugin.activation_checkpointing = trainer.args.fsdp_config.get(
            "activation_checkpointing", False
        )
    if state.mixed_precision != "no":
        # What AcceleratorState does with the plugin it is given: `bf16=True` becomes FSDP2's
        # MixedPrecisionPolicy (bf16 parameters and gradient reduction).
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    # On both states, as AcceleratorState records it: every later `AcceleratorState()` copies
    # PartialState's distributed type over its own, and a Trainer back on MULTI_CPU saves
    # (`save_model`, `get_state_dict`) as if the model were not sharded: rank 0 alone gathers
    # the sharded parameters and hangs.
    state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def adapt_trainer(module: types.ModuleType) -> None:
    """FSDP asked of the Trainer on CPU ranks: FSDP2 (FSDP1 needs an accelerator device)."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def create_accelerator_and_postprocess(self: Any) -> None:
            fsdp = bool(self.args.fsdp)
            if fsdp and os.environ.get("FSDP_VERSION", "1") != "2":
                # The state dict type stays the cell's (FULL_STATE_DICT unless it asks): a
                # sharded one has `save_model` write no weights `from_pretrained` can load.
                os.environ["FSDP_VERSION"] = "2"
                note("the Trainer's FSDP shards with FSDP2 (fully_shard) on the CPU")
            original(self)
            if fsdp:
                shard_with_fsdp2_on_cpu(self)

        return create_accelerator_and_postprocess

    replace(CREATE_ACCELERATOR, module.Trainer, "create_accelerator_and_postprocess", make)


def unwrap_without_deepspeed(module: types.ModuleType) -> None:
    """accelerate's `extract_model_from_parallel` (the Trainer's `unwrap_model`, on every save)
    looks for DeepSpeed's engine only once DeepSpeed is imported: a DDP or FSDP rank never
    imports it (about 0.6 s of a core each, and a launch agent's preload) just to find its model
    is not one. `module` is `accelerate.utils.other`; the check stays as it was once DeepSpeed
    is loaded (a ZeRO run imports it to build its engine)."""

    def make(original: Callable[..., bool]) -> Callable[..., bool]:
        def is_deepspeed_available() -> bool:
            return "deepspeed" in sys.modules and original()

        return is_deepspeed_available

    replace(UNWRAP_MODEL, module, "is_deepspeed_available", make)


def check_accelerate(cpu_ranks: bool) -> Callable[[types.ModuleType], None]:
    """accelerate's state joins the launched world, or fails naming itself.

    On CPU ranks a bare `PartialState()` (accelerate's own `test_ops` in 1.8 to 1.13, a cell
    that asks `PartialState().is_main_process`) reads `ACCELERATE_USE_CPU` as `Accelerator()`
    and `AcceleratorState()` do: otherwise it looks for an accelerator, finds none and sets
    itself up as one process, while the launch has several.
    """

    def hook(module: types.ModuleType) -> None:
        from accelerate.utils import parse_flag_from_env

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def __init__(self: Any, cpu: bool = False, **kwargs: Any) -> None:
                asked = parse_flag_from_env("ACCELERATE_USE_CPU")
                if cpu_ranks and asked and not cpu and not self.initialized:
                    cpu = True
                    note("accelerate's PartialState() runs as CPU (ACCELERATE_USE_CPU)")
                original(self, cpu, **kwargs)
                world, _ = launched_world()
                if world > 1 and self.num_processes != world:
                    raise single_process(
                        "Hugging Face accelerate",
                        self.num_processes,
                        f" (distributed type {self.distributed_type})",
                    )

            return __init__

        replace(PARTIAL_STATE, module.PartialState, "__init__", make)

    return hook
