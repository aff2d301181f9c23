"""Faults injected from inside the ranks of a `benchmarks.chaos` run.

`benchmarks.chaos` puts this folder first on the run's PYTHONPATH, so every Python process of
the run imports this module at start-up (Python's `site` imports any `sitecustomize` on the
path). It does nothing unless `CHAOS_CONTROL` names the benchmark's control folder; then it
installs the hooks below, which act only in a rank of a launch (torch elastic sets
`TORCHELASTIC_RUN_ID` and `RANK` in it). CPU ranks are forked from the launch's agent, which
imported this module at its own start, so the checks are made when a hook fires.

- **hang:** SIGUSR2 makes the rank's main thread sleep for an hour where it stands (in its
  step, or in a collective once that returns): a hung rank, for the hang watchdog to find.
- **torn checkpoint:** with `<control>/armed/torn` present, the next rank about to mark a
  checkpoint complete (`trainflow.checkpoint.mark_complete`, which every pipeline's checkpoint
  goes through) claims the fault, truncates every file already written in the checkpoint's
  folder to half its size and SIGKILLs itself before the marker is written: a write torn by a
  crash.
- **full disk:** with `<control>/armed/enospc` present, the next rank that opens a file for
  writing inside a checkpoint folder (`.step_N.partial/` or `checkpoint-N/`) claims the fault:
  the file is created empty and the open raises `OSError(ENOSPC)`, as a full disk would.

A claimed fault writes `<control>/fired/<kind>.json` (`{"time", "step", "rank", "pid"}`) so the
benchmark knows when and where it landed. Claiming is one `os.rename` of the armed file: of
ranks racing for it, exactly one wins.
"""

import builtins
import errno
import io
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

CONTROL_ENV = "CHAOS_CONTROL"
_CHECKPOINT_PART = re.compile(r"^(?:\.step_(\d+)\.partial|checkpoint-(\d+))$")


def _in_rank() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def _claim(control: Path, kind: str) -> bool:
    if not _in_rank():
        return False
    try:
        os.rename(control / "armed" / kind, control / "armed" / f"{kind}.{os.getpid()}")
    except FileNotFoundError:
        return False
    return True


def _fired(control: Path, kind: str, step: int) -> None:
    record = {"time": time.time(), "step": step, "rank": int(os.environ.get("RANK", "-1"))}
    tmp = control / "fired" / f".{kind}.tmp"
    tmp.write_text(json.dumps({**record, "pid": os.getpid()}))
    os.replace(tmp, control / "fired" / f"{kind}.json")


def _checkpoint_step(path: Path) -> int | None:
    """The step of the checkpoint folder `path` is in, if it is in one."""
    for part in reversed(path.parts):
        if match := _CHECKPOINT_PART.match(part):
            return int(match.group(1) or match.group(2))
    return None


def _hang(signum, frame) -> None:
    if _in_rank():
        time.sleep(3600)


def _tear_then_die(control: Path, mark_complete):
    def torn(path, step, **info):
        if _claim(control, "torn"):
            for file in Path(path).rglob("*"):
                if file.is_file():
                    os.truncate(file, file.stat().st_size // 2)
            _fired(control, "torn", step)
            os.kill(os.getpid(), signal.SIGKILL)
        return mark_complete(path, step, **info)

    return torn


def _full_disk(control: Path, real_open):
    def open_(file, mode="r", *args, **kwargs):
        if (
            isinstance(file, str | os.PathLike)
            and any(c in mode for c in "wax+")
            and (step := _checkpoint_step(Path(os.fspath(file)))) is not None
            and _claim(control, "enospc")
        ):
            real_open(file, "wb").close()
            _fired(control, "enospc", step)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    return open_


class _PatchOnImport:
    """Wrap `trainflow.checkpoint.mark_complete` once that module is imported."""

    def __init__(self, control: Path):
        self.control = control

    def find_spec(self, name, path=None, target=None):
        if name != "trainflow.checkpoint":
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        control = self.control

        def patched(module):
            exec_module(module)
            module.mark_complete = _tear_then_die(control, module.mark_complete)

        spec.loader.exec_module = patched
        return spec


def _install() -> None:
    control = os.environ.get(CONTROL_ENV)
    if not control:
        return
    control_dir = Path(control)
    signal.signal(signal.SIGUSR2, _hang)
    sys.meta_path.insert(0, _PatchOnImport(control_dir))
    real_open = io.open
    builtins.open = io.open = _full_disk(control_dir, real_open)


_install()
