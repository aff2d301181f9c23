"""Patches into Lightning: its Trainer joins the launched world (and runs on CPU ranks), and
its SIGTERM handler leaves SIGTERM to the launcher.

Written and tested for Lightning 2.6 (`lightning` and `pytorch_lightning`).
"""

import inspect
import types
from collections.abc import Callable
from typing import Any

from trainflow.compat.adaptations import launched_world, note, single_process
from trainflow.compat.patching import check, declare, replace

LIGHTNING = ">=2.5,<2.7"

TRAINER_INIT = declare(
    "lightning: Trainer.__init__",
    "lightning",
    LIGHTNING,
    target="lightning.pytorch.trainer.trainer:Trainer.__init__",
    params=("self", "accelerator", "devices", "num_nodes"),
    why="devices='auto' is the launched ranks and num_nodes the launched nodes; on CPU ranks "
    "accelerator='gpu' runs on the CPU; a Trainer that ended single-process fails, naming it",
)
SIGNAL_CONNECTOR = declare(
    "lightning: Trainer._signal_connector (_SignalConnector)",
    "lightning",
    LIGHTNING,
    target="lightning.pytorch.trainer.connectors.signal_connector:_SignalConnector",
    params=("trainer",),
    outside="refuse",
    why="Lightning's SIGTERM handler broadcasts inside the signal handler, mid-collective: gloo "
    "aborts the rank before any checkpoint is written",
    public_api="none: Lightning has no option to leave SIGTERM alone",
)


def bound_arguments(fn: Callable[..., Any], args: tuple, kwargs: dict) -> inspect.BoundArguments:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def leave_sigterm_to_launcher(trainer: Any) -> None:
    """Swap `trainer`'s signal connector for one that leaves SIGTERM to the handler the
    launcher gave the rank (`runtime.request_stop`).

    Lightning's own SIGTERM handler broadcasts from inside the signal handler, in the middle of
    whatever collective the rank was running (a DDP all-reduce or buffer broadcast): gloo then
    aborts the rank ("Received data size doesn't match expected size") before any checkpoint
    is written. The launcher's handler only sets a flag, and the workload turns it into a
    checkpoint and a stop at a step every rank agrees on.
    """
    check(SIGNAL_CONNECTOR)
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    class LauncherOwnsSigterm(_SignalConnector):
        def register_signal_handlers(self) -> None:
            self.received_sigterm = False

    trainer._signal_connector = LauncherOwnsSigterm(trainer)


def adapt_trainer(cpu: bool) -> Callable[[types.ModuleType], None]:
    def hook(module: types.ModuleType) -> None:
        trainer = module.Trainer

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                bound = bound_arguments(original, (self, *args), kwargs)
                world, local = launched_world()
                given = bound.arguments
                if cpu and str(given.get("accelerator")) in ("gpu", "cuda"):
                    note(f"Lightning accelerator={given['accelerator']!r} runs on the CPU")
                    given["accelerator"] = "cpu"
                devices = given.get("devices")
                if devices in ("auto", -1, "-1"):
                    given["devices"] = local
                    given["num_nodes"] = max(world // local, 1)
                elif cpu and devices != local:
                    note(f"Lightning devices={devices!r} is taken as the {local} launched ranks")
                    given["devices"] = local
                    given["num_nodes"] = max(world // local, 1)
                original(*bound.args, **bound.kwargs)
                if world > 1 and self.world_size != world:
                    raise single_process("Lightning", self.world_size)

            return __init__

        replace(TRAINER_INIT, trainer, "__init__", make)

    return hook
