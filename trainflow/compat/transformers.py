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
import types
from collections.abc import Callable
from typing import Any

from trainflow.compat.adaptations import launched_world, note, single_process
from trainflow.compat.patching import check, declare, replace

TRANSFORMERS = ">=4.51,<5.23"
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
