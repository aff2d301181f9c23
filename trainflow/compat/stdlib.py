"""Patches into the standard library: running or dropping the exit handlers without the
interpreter's teardown.

Written and tested for CPython 3.11 to 3.13.
"""

import atexit
import os
import sys
from typing import NoReturn

from trainflow.compat.patching import PYTHON, check, declare, relies_on

CPYTHON = ">=3.11,<3.14"

RUN_EXITFUNCS = declare(
    "python: atexit._run_exitfuncs",
    PYTHON,
    CPYTHON,
    target="atexit:_run_exitfuncs",
    why="a process whose work is done runs its exit handlers, then exits without tearing "
    "down every loaded module (about 2 s with torch, transformers and Prefect loaded)",
)
CLEAR = declare(
    "python: atexit._clear",
    PYTHON,
    CPYTHON,
    target="atexit:_clear",
    why="a rank forked from a standby agent drops the agent's exit handlers",
    public_api="atexit.unregister, given each handler, which a fork does not know",
)


def run_exit_handlers() -> bool:
    """Run the exit handlers registered so far (in a process that will end with `os._exit`);
    whether they could be run."""
    if relies_on(RUN_EXITFUNCS):
        return False
    check(RUN_EXITFUNCS)
    atexit._run_exitfuncs()
    return True


def exit_now(code: int = 0) -> NoReturn:
    """Run the exit handlers, flush the streams and exit with `code`, skipping the
    interpreter's teardown of loaded modules; a plain `sys.exit` where `atexit` cannot."""
    if not run_exit_handlers():
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def clear_exit_handlers() -> None:
    """Drop every exit handler registered so far (a forked child's copy of its parent's)."""
    if relies_on(CLEAR):
        return
    check(CLEAR)
    atexit._clear()
