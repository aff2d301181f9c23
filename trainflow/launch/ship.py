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


def remote_payload(shipment: Shipment) -> bytes:
    """The payload of a call that runs on another machine (a remote deployment, whose own
    launch ships it on to its ranks): unpickled there, it is the same `(fn, args, kwargs)`,
    with the caller's file names and source lines given back to code shipped by value first,
    so that the ranks' tracebacks there show the caller's file and lines too."""
    return cloudpickle.dumps(_WithSource(shipment.payload, shipment.code_files, shipment.sources))


@dataclass(frozen=True)
class _WithSource:
    payload: bytes
    code_files: list[list]
    sources: dict[str, list[str]]

    def __reduce__(self) -> tuple:
        return (open_payload, (self.payload, self.code_files, self.sources))


def open_payload(
    payload: bytes, code_files: list[list], sources: dict[str, list[str]]
) -> tuple[Callable[..., Any], tuple, dict]:
    """`(fn, args, kwargs)` of `payload`, with the source of code shipped by value restored
    (`restore_source`): what unpickling a `remote_payload` calls."""
    fn, args, kwargs = cloudpickle.loads(payload)
    restore_source(fn, code_files, sources)
    return fn, args, kwargs


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


def restore_source(fn: object, code_files: list[list], sources: dict[str, list[str]]) -> None:
    """Give the code the caller shipped by value its file name and source back.

    cloudpickle ships functions from `__main__` or a notebook with their code only, named
    "<dynamic-code>": tracebacks printed on the rank would show no file and no source line.
    The caller sends where each function's code lives and those files' lines; they go into
    `linecache` (a notebook cell exists nowhere else) and the code objects get their names.
    """
    for path, lines in sources.items():
        linecache.cache[path] = (sum(map(len, lines)), None, lines, path)
    where = {(name, first): path for name, first, path in code_files}

    def fix(code: types.CodeType) -> types.CodeType:
        consts = tuple(fix(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
        path = where.get((code.co_name, code.co_firstlineno))
        if code.co_filename != DYNAMIC_CODE or path is None:
            return code.replace(co_consts=consts)
        return code.replace(co_filename=path, co_consts=consts)

    todo, seen = [fn], set()
    while todo:
        f = todo.pop()
        if id(f) in seen or not isinstance(f, types.FunctionType):
            continue
        seen.add(id(f))
        if f.__code__.co_filename == DYNAMIC_CODE:
            f.__code__ = fix(f.__code__)
            todo.extend(f.__globals__.values())
            todo.extend(c.cell_contents for c in f.__closure__ or () if _has_contents(c))


def _has_contents(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True
