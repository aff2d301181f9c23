"""A framework's own training loop reporting its steps, as our loop does.

Each optimizer step, every rank records a heartbeat (`runtime.heartbeat`: the launcher's hang
watchdog) and rank 0 writes the run's progress file (`tracking.ProgressFile`), which the
pipeline forwards to its `<name>-progress` artifact. The frameworks are told through their own
extension points: a transformers `TrainerCallback` (Unsloth's TRL trainer takes it directly;
Axolotl through its plugin, `AxolotlProgressPlugin`) and a Composer `Callback` registered with
LLM Foundry (`foundry_callback`).

Only the standard library is imported here: the framework's classes are made when first used,
in its own environment.
"""

import functools
from typing import Any

#: LLM Foundry's registry name for `foundry_callback`'s class (`callbacks:` in its YAML).
FOUNDRY_CALLBACK = "trainflow_progress"
#: Axolotl loads plugins by "module.Class" (`plugins:` in its YAML).
AXOLOTL_PLUGIN = f"{__name__}.AxolotlProgressPlugin"

# The progress file of this rank's run, for the Axolotl plugin, which Axolotl itself makes.
_axolotl_progress_file: str | None = None


def report(progress_file: str | None, step: int, max_steps: int) -> None:
    """`step` of `max_steps` done on this rank: its heartbeat; rank 0 also writes the progress
    file (when there is one and the number of steps is known)."""
    from trainflow import runtime
    from trainflow.tracking import ProgressFile

    runtime.heartbeat(step)
    if progress_file and max_steps > 0 and runtime.is_rank_zero():
        ProgressFile(progress_file, max_steps).update(min(step, max_steps))


def trainer_callback(progress_file: str | None) -> Any:
    """A transformers `TrainerCallback` that reports at the start and after each step."""
    from transformers import TrainerCallback

    class TrainerProgress(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            report(progress_file, state.global_step, state.max_steps)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            report(progress_file, state.global_step, state.max_steps)

    return TrainerProgress()


def report_axolotl_to(progress_file: str | None) -> None:
    """Where the Axolotl plugin of this rank reports (set before Axolotl loads its config)."""
    global _axolotl_progress_file
    _axolotl_progress_file = progress_file


@functools.cache
def _axolotl_plugin() -> type:
    from axolotl.integrations.base import BasePlugin

    class AxolotlProgressPlugin(BasePlugin):
        """Adds `trainer_callback` to the Trainer Axolotl builds."""

        def add_callbacks_pre_trainer(self, cfg: Any, model: Any) -> list[Any]:
            return [trainer_callback(_axolotl_progress_file)]

    return AxolotlProgressPlugin


@functools.cache
def _foundry_callback() -> type:
    from composer.core import Callback, TimeUnit

    class FoundryProgress(Callback):
        """Reports Composer's batches: LLM Foundry's optimizer steps."""

        def __init__(self, progress_file: str | None = None):
            self.progress_file = progress_file

        def _report(self, state: Any) -> None:
            duration, total = state.max_duration, 0
            if duration is not None and duration.unit == TimeUnit.BATCH:
                total = int(duration.value)
            elif duration is not None and duration.unit == TimeUnit.EPOCH and state.dataloader_len:
                total = int(duration.value) * int(state.dataloader_len)
            report(self.progress_file, int(state.timestamp.batch), total)

        def fit_start(self, state: Any, logger: Any) -> None:
            self._report(state)

        def batch_end(self, state: Any, logger: Any) -> None:
            self._report(state)

    return FoundryProgress


def foundry_callback() -> str:
    """Register the Composer callback with LLM Foundry (once per process); its name there."""
    from llmfoundry.registry import callbacks

    if FOUNDRY_CALLBACK not in callbacks.get_all():
        callbacks.register(FOUNDRY_CALLBACK, func=_foundry_callback())
    return FOUNDRY_CALLBACK


def __getattr__(name: str) -> Any:
    # Axolotl imports its plugin class by name; the class subclasses Axolotl's own, so it is
    # made on first use, in Axolotl's environment.
    if name == "AxolotlProgressPlugin":
        return _axolotl_plugin()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
