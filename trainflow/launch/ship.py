"""Shipping a call to the ranks: the function and its arguments pickled, with what a rank
needs to show the caller's source (a notebook cell, a script) in its tracebacks."""

import inspect
import linecache
import os
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle

from trainflow.errors import PayloadError

# Source shipped with the payload for rank tracebacks, at most (a module, a notebook).
MAX_SHIPPED_SOURCE_BYTES = 2_000_000
# cloudpickle's file name for the code of a function it ships by value.
DYNAMIC_CODE = "<dynamic-code>"

# (function name, first line, last line, file) of code the caller shipped.
CodeSpan = tuple[str, int, int, str]


@dataclass(frozen=True)
class Shipment:
    """A call ready to travel to the ranks: the pickled function and arguments, and what the
    ranks need to show the caller's source in their tracebacks."""

    name: str
    qualname: str
    payload: bytes
    code_files: list[list]
    sources: dict[str, list[str]]
    shipped: list[CodeSpan]
    sys_path: list[str]


def ship(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Shipment:
    """Pickle `fn(*args, **kwargs)` for the ranks (raises `PayloadError` naming what cannot)."""
    payload = bind_payload(fn, args, kwargs)
    codes = _shipped_codes(fn)
    code_files, sources = _shipped_sources(codes)
    name = getattr(fn, "__name__", "fn")
    return Shipment(
        name=name,
        qualname=getattr(fn, "__qualname__", name),
        payload=payload,
        code_files=code_files,
        sources=sources,
        shipped=_shipped_code(codes),
        sys_path=caller_sys_path(),
    )


def bind_payload(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    """Pickle function and arguments, naming the first one that cannot travel."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise PayloadError(f"{name}() cannot be called with these arguments: {exc}") from exc
    except ValueError:  # builtins without a signature: let the call itself complain
        bound = None
    try:
        cloudpickle.dumps(fn)
    except Exception as exc:
        raise PayloadError(
            f"function {name} cannot be sent to the ranks (pickling failed): {exc}"
        ) from exc
    items = bound.arguments.items() if bound else enumerate((*args, *kwargs.values()))
    for arg_name, value in items:
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            raise PayloadError(
                f"argument {arg_name!r} of {name} ({type(value).__qualname__}) cannot be sent "
                f"to the ranks (pickling failed): {exc}"
            ) from exc
    return cloudpickle.dumps((fn, args, kwargs))


def caller_sys_path() -> list[str]:
    return [os.path.abspath(p) if p else os.getcwd() for p in sys.path]


def _shipped_codes(fn: Callable[..., Any]) -> list[types.CodeType]:
    """The code of `fn` and of the functions nested in it; with `__main__`, its module's too.

    cloudpickle ships functions from `__main__` (a script, a notebook) by value and names
    their file "<dynamic-code>", so a rank's stack would show only function and line for them.
    The caller still has the code objects, hence the files.
    """
    module = getattr(fn, "__module__", None)
    functions = [fn]
    if module == "__main__" or module not in sys.modules:  # its module travels by value too
        functions += [
            f
            for f in getattr(fn, "__globals__", {}).values()
            if isinstance(f, types.FunctionType) and f.__module__ == module
        ]
    todo = [f.__code__ for f in functions if hasattr(f, "__code__")]
    codes: list[types.CodeType] = []
    while todo:
        code = todo.pop()
        codes.append(code)
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return codes


def _shipped_code(codes: Sequence[types.CodeType]) -> list[CodeSpan]:
    """Where shipped code (see `_shipped_codes`) is: function, first and last line, file."""
    spans: list[CodeSpan] = []
    for code in codes:
        lines = [line for _, _, line in code.co_lines() if line is not None]
        first, last = min(lines, default=code.co_firstlineno), max(lines, default=0)
        spans.append((code.co_name, first, last, code.co_filename))
    return spans


def _shipped_sources(
    codes: Sequence[types.CodeType],
) -> tuple[list[list], dict[str, list[str]]]:
    """What a rank needs to show the source of code shipped by value in its tracebacks.

    `[name, first line, file]` of each code object, and the lines of the files a rank may not
    have: notebook cells (held in `linecache`, in no file) and the caller's script, which a
    remote worker lacks. An importable module's file is wherever the module can be imported.
    """
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    sources: dict[str, list[str]] = {}
    size = 0
    for path in dict.fromkeys(c.co_filename for c in codes):
        if os.path.isfile(path) and path != script:
            continue
        lines = linecache.getlines(path)
        size += sum(map(len, lines))
        if lines and size <= MAX_SHIPPED_SOURCE_BYTES:
            sources[path] = lines
    return [[c.co_name, c.co_firstlineno, c.co_filename] for c in codes], sources
