"""The one way trainflow patches another package: declared, version-checked, never blind.

Each patch is declared once, at import of its compat module, with the version range of the
package it was written and tested for (`declare`). Applying it (`replace`, or `check` before
code that reaches into a private name) first checks the installed version:

- inside the range, it applies;
- outside it, a patch whose failure would only cost speed or a nicer message warns once,
  naming the package, the installed version and the patch, then applies if what it replaces
  is still there, and skips with that warning if it is not;
- outside it, a patch whose failure would make a run silently wrong (`outside="refuse"`)
  raises `CompatError` instead, before anything runs.

`PATCHES` lists every declared patch; `tests/unit/test_compat.py` checks each against the
installed packages (the version, and the signature or attribute it relies on), and
`docs/architecture.md` lists them.
"""

import functools
import importlib
import importlib.metadata
import inspect
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# The interpreter itself, for patches into the standard library.
PYTHON = "python"


class CompatError(RuntimeError):
    """A patch cannot be applied safely to the installed version of its package."""


class CompatWarning(UserWarning):
    """A patch was written for other versions of its package than the one installed."""


@dataclass(frozen=True)
class Patch:
    """One patch into another package's internals."""

    name: str  # what is replaced or read, as `package: owner.attribute`
    package: str  # the distribution it patches ("torch", "transformers"); PYTHON: stdlib
    versions: str  # the range it was written and tested for, PEP 440 ("~=2.14.0", ">=4.51")
    # `module:qualname` of what the patch replaces or reads, and the parameters it relies on:
    # the test checks both against the installed package.
    target: str
    params: tuple[str, ...] = ()
    outside: Literal["warn", "refuse"] = "warn"
    why: str = ""
    # The public API that would let trainflow drop the patch, once there is one.
    public_api: str = ""


PATCHES: dict[str, Patch] = {}
_warned: set[str] = set()
_lock = threading.Lock()


def declare(
    name: str,
    package: str,
    versions: str,
    target: str,
    params: tuple[str, ...] = (),
    outside: Literal["warn", "refuse"] = "warn",
    why: str = "",
    public_api: str = "",
) -> Patch:
    patch = Patch(name, package, versions, target, params, outside, why, public_api)
    SpecifierSet(versions)  # a malformed range fails at import, in every test run
    PATCHES[name] = patch
    return patch


def installed_version(package: str) -> str | None:
    """The installed version of `package` (PYTHON: the interpreter's), or None."""
    if package == PYTHON:
        return ".".join(map(str, sys.version_info[:3]))
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def in_range(patch: Patch, version: str | None) -> bool:
    if version is None:
        return False
    try:
        # Local labels ("2.13.0+cpu") are builds of the same release.
        return Version(version).public in SpecifierSet(patch.versions, prereleases=True)
    except InvalidVersion:
        return False


def check(patch: Patch) -> bool:
    """Whether `patch` may be applied to the installed version of its package: True in its
    range; outside, True after a warning (once per patch), or `CompatError` for a patch that
    refuses. Call it before applying a patch by other means than `replace`."""
    version = installed_version(patch.package)
    if in_range(patch, version):
        return True
    message = (
        f"{patch.package} {version or '(not installed)'} is outside the versions "
        f"({patch.versions}) that trainflow's patch {patch.name!r} was written and tested for"
    )
    if patch.outside == "refuse":
        raise CompatError(
            f"{message}; it is not applied, and running without it would give wrong results. "
            f"Install {patch.package}{patch.versions}."
        )
    _warn_once(patch, f"{message}; it is applied as long as what it replaces is there.")
    return True


def resolve(target: str) -> Any:
    """The object `module:qual.name` names (imported); AttributeError if it is gone."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def relies_on(patch: Patch) -> list[str]:
    """What `patch` relies on that the installed package no longer has: empty when the
    target exists and takes every parameter the patch passes or reads."""
    try:
        obj = resolve(patch.target)
    except (ImportError, AttributeError) as exc:
        return [f"{patch.target} is gone ({exc})"]
    if not patch.params:
        return []
    try:
        names = set(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return [f"{patch.target} has no signature to check"]
    return [f"{patch.target} takes no parameter {p!r}" for p in patch.params if p not in names]


def replace(
    patch: Patch,
    owner: Any,
    attribute: str,
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> bool:
    """Replace `owner.attribute` with `make(original)` once `check(patch)` allows it, keeping
    the original's name and docs. Returns whether it was replaced: not when the attribute is
    gone (warned once; `CompatError` for a patch that refuses)."""
    check(patch)
    original = getattr(owner, attribute, None)
    if original is None:
        skip(patch, f"{attribute} is gone")
        return False
    setattr(owner, attribute, functools.wraps(original)(make(original)))
    return True


def skip(patch: Patch, reason: str) -> None:
    """`patch` cannot be applied (`reason`): warn once, or `CompatError` if it refuses."""
    check(patch)
    message = f"trainflow's patch {patch.name!r} cannot be applied: {reason}"
    if patch.outside == "refuse":
        raise CompatError(message)
    _warn_once(patch, message + "; it is skipped.")


def _warn_once(patch: Patch, message: str) -> None:
    key = f"{patch.name}: {message.partition(';')[0]}"
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, CompatWarning, stacklevel=3)
