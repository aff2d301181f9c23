"""Where trainflow keeps its files: one root, overridable with TRAINFLOW_HOME."""

import os
import re
from pathlib import Path

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def trainflow_home() -> Path:
    """Root for runs, datasets and caches: `$TRAINFLOW_HOME`, else ~/.cache/trainflow."""
    return Path(os.environ.get("TRAINFLOW_HOME") or Path.home() / ".cache" / "trainflow")


def safe_name(value: str, what: str = "name") -> str:
    """Return `value` if it is usable as one path component, else raise naming `what`.

    Rejects separators, `..`, leading dots and anything outside `[A-Za-z0-9._-]`, so a run,
    dataset or model name can never escape the folder it is written under.
    """
    if not _SAFE_NAME.match(value) or ".." in value:
        raise ValueError(
            f"{what} {value!r} is not a safe name: use letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, at most 128 characters"
        )
    return value
