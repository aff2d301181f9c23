"""The SFT Trainer's checkpoints: whole before a resume may read them, and written at once or in
the background (`async_checkpoints`).

The Trainer writes `checkpoint-N` on every rank; `DurableCallback` then adds the loader's
position and the completion marker once every rank's part is written. In the background, the
training thread copies what the checkpoint holds to host memory (`compat.transformers`) and
`BackgroundSaves` writes it and publishes it from a thread, one checkpoint in flight at most.
"""

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from trainflow import runtime

DATA_STATE = "data_state.json"


class BackgroundSaves:
    """The writes of one checkpoint, run by a thread; the next save waits for them first.

    The Trainer's save hands its writes over (`add`, `compat.transformers`), then
    `DurableCallback.on_save` starts them (`start`). The last step's checkpoint and a stop's
    are written at once (`in_background`).
    """

    def __init__(self, enabled: bool, stopping: Callable[[], bool]) -> None:
        self.enabled = enabled
        self.stopping = stopping
        self.writes: list[Callable[[], None]] = []
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def in_background(self, step: int, max_steps: int) -> bool:
        return self.enabled and step < max_steps and not self.stopping()

    def add(self, write: Callable[[], None]) -> None:
        self.writes.append(write)

    def start(self, publish: Callable[[bool], None]) -> None:
        """Run the writes handed over, then `publish(written)` (every rank calls it), in a
        thread."""
        writes, self.writes = self.writes, []

        def run() -> None:
            failed: BaseException | None = None
            try:
                for write in writes:
                    write()
            except BaseException as exc:  # kept for the training thread, which raises it
                failed = exc
            try:
                publish(failed is None)
            except BaseException as exc:
                failed = failed or exc
            self.error = failed

        self.thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        """Return once the checkpoint in flight is written and published.

        Raises:
            RuntimeError: its write failed on this rank or another; the checkpoint is left
                without its marker, so no resume reads it.
        """
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"a background checkpoint write failed: {error}") from error


class DurableCallback(TrainerCallback):
    """Checkpoints a resume can trust, and a stop that leaves one behind.

    - After the Trainer saved `checkpoint-N` on every rank, rank 0 adds the loader's position
      (`data_state.json`) and the completion marker, so a resume only ever reads a whole
      checkpoint and continues at the next unseen sample; then it deletes the complete
      checkpoints beyond the newest `keep`.
    - With `background`, the ranks write `checkpoint-N` from host copies in a thread
      (`BackgroundSaves`) and agree through a gloo group of its own that every rank's write
      ended before rank 0 adds the marker.
    - After every step the ranks agree whether a stop was requested (SIGTERM: a preemption,
      Ctrl-C or a cancel upstream); if so the Trainer saves and stops at that step.
    """

    def __init__(
        self, loader: Any, checkpointing: bool, technique: str, keep: int, background: bool
    ) -> None:
        self.loader = loader
        self.checkpointing = checkpointing
        self.technique = technique
        self.keep = keep
        self.stopped_at: int | None = None
        self.saves = BackgroundSaves(background, lambda: self.stopped_at is not None)
        self.save_group: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import torch.distributed as dist

        if self.saves.enabled and dist.is_initialized():
            # The writing thread's collectives never interleave with the training group's.
            self.save_group = dist.new_group(backend="gloo")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        runtime.heartbeat(state.global_step)
        if runtime.should_stop():
            self.stopped_at = state.global_step
            control.should_save = self.checkpointing
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        step = state.global_step
        data_state = self.loader.state_dict()  # every rank: it counts this rank's samples
        if self.saves.in_background(step, state.max_steps):
            self.saves.start(lambda written: self._publish(folder, step, data_state, written))
        else:
            self._publish(folder, step, data_state, written=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.saves.wait()

    def _publish(self, folder: Path, step: int, data_state: Any, written: bool) -> None:
        """Once every rank's part of `folder` is written, mark it complete (rank 0)."""
        import torch
        import torch.distributed as dist

        from trainflow import checkpoint, storage

        if dist.is_initialized() and self.save_group is None:
            dist.barrier()  # every rank has written its part of the checkpoint
        elif dist.is_initialized():
            failed = torch.tensor([0 if written else 1])
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.save_group)
            written = not failed.item()
        if written and runtime.is_rank_zero():
            (folder / DATA_STATE).write_text(json.dumps(data_state))
            checkpoint.mark_complete(
                folder, step, technique=self.technique, world_size=runtime.get_world_size()
            )
            storage.mirror_checkpoint(folder)  # a run kept in object storage: upload it there
            checkpoint.prune(folder.parent, self.keep)  # only once a newer one is complete
        if dist.is_initialized():
            dist.barrier(group=self.save_group)
        if not written:
            raise RuntimeError(f"{folder.name} was not written on every rank; it is not marked")


def read_data_state(checkpoint_dir: Path) -> dict[str, Any] | None:
    """The loader position saved with a checkpoint, if any."""
    path = checkpoint_dir / DATA_STATE
    return json.loads(path.read_text()) if path.is_file() else None
