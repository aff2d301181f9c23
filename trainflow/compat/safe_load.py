"""Checkpoint loads that refuse pickled code: torch's distributed checkpoint (DCP) and DeepSpeed.

A checkpoint is data, yet two readers trainflow resumes through unpickle it with full pickle,
so a file planted in a checkpoint folder runs code in every rank that resumes from it:

- DCP's `FileSystemReader.read_metadata` reads `.metadata` with `pickle.load`, and its
  `DefaultLoadPlanner.load_bytes` reads every non-tensor value (the optimizer's param groups)
  with `torch.load(weights_only=False)`. Our own DDP and FSDP checkpoints, Lightning's FSDP2
  checkpoints and the Hugging Face Trainer's FSDP checkpoints are all read through them.
- DeepSpeed's `TorchCheckpointEngine.load` reads every file of its checkpoints with
  `torch.load(weights_only=False)`, under our loop, the Trainer and Lightning alike.

`install` (called by every strategy, so on every rank before anything is loaded) replaces
the three: `.metadata` is read by an unpickler that builds only DCP's own metadata classes, and
the other two load with `weights_only=True` (DeepSpeed's few classes allowlisted). A file that
holds anything else is refused with `UnsafeCheckpointError`, naming it, before any of its code
runs. The other formats trainflow reads are loaded with `weights_only=True` by their readers
(`torch_load` here for ours, `weights_only=True` for Lightning's `.ckpt`, the Trainer's own
loads for its files). `check_checkpoint` reads a whole checkpoint folder that way before a
resume hands it to any of them, and names the file it refuses.

Written and tested for torch 2.14 and DeepSpeed 0.19.
"""

import io
import json
import pickle
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from trainflow.compat.deepspeed import DEEPSPEED
from trainflow.compat.patching import check, declare, replace
from trainflow.compat.torch import TORCH

_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"

READ_METADATA = declare(
    "torch: FileSystemReader.read_metadata",
    "torch",
    TORCH,
    target=f"{_DCP_FILESYSTEM}:FileSystemReader.read_metadata",
    params=("self",),
    outside="refuse",
    why="DCP unpickles `.metadata` with full pickle: a planted pickle runs code on resume",
    public_api="none: FileSystemReader has no option for a restricted unpickler",
)
READ_DATA = declare(
    "torch: FileSystemReader.read_data",
    "torch",
    TORCH,
    target=f"{_DCP_FILESYSTEM}:FileSystemReader.read_data",
    params=("self", "plan", "planner"),
    why="names the file of a non-tensor value `load_bytes` refused (the planner knows only "
    "the entry)",
)
LOAD_BYTES = declare(
    "torch: DefaultLoadPlanner.load_bytes",
    "torch",
    TORCH,
    target="torch.distributed.checkpoint.default_planner:DefaultLoadPlanner.load_bytes",
    params=("self", "read_item", "value"),
    outside="refuse",
    why="DCP loads non-tensor values with torch.load(weights_only=False)",
)
DEEPSPEED_LOAD = declare(
    "deepspeed: TorchCheckpointEngine.load",
    "deepspeed",
    DEEPSPEED,
    target="deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine:TorchCheckpointEngine.load",
    params=("self", "path", "map_location"),
    outside="refuse",
    why="DeepSpeed loads its checkpoint files with torch.load(weights_only=False)",
)

# What DCP's `.metadata` pickles: its own dataclasses, torch's dtypes, sizes and layouts, and
# the paths of its files. Nothing here runs code when built from a pickle.
_DCP_CLASSES = {
    _DCP_METADATA: {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    _DCP_FILESYSTEM: {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}

# The classes DeepSpeed pickles into its optimizer files beside tensors (`module.name`).
_DEEPSPEED_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler:LossScaler",
    "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
    "deepspeed.runtime.zero.config:ZeroStageEnum",
    "deepspeed.utils.tensor_fragment:fragment_address",
)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds more than data: loading it would run its code, so it is refused.

    `item` is the checkpoint entry refused when only the entry is known where it is refused
    (DCP's planner), for the reader to name its file.
    """

    def __init__(self, message: str, item: str | None = None) -> None:
        super().__init__(message)
        self.item = item


def _refused(what: str, found: str, item: str | None = None) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{what}: refused to load: it holds {found}, which a checkpoint never needs (a "
        "planted file runs code when unpickled). Delete the checkpoint or resume from another.",
        item,
    )


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, building only the classes `_DCP_CLASSES` names."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        allowed = name in _DCP_CLASSES.get(module, ())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"the global {module}.{name}")
        return super().find_class(module, name)


def load_metadata(stream: IO[bytes], what: str) -> Any:
    """The DCP metadata pickled in `stream` (`what` names it in errors), or
    `UnsafeCheckpointError` for anything but DCP's metadata."""
    try:
        return _MetadataUnpickler(stream).load()
    except pickle.UnpicklingError as exc:
        raise _refused(what, str(exc)) from None


def torch_load(
    source: str | Path | IO[bytes],
    what: str | None = None,
    map_location: Any = None,
    allowed: Iterable[Any] = (),
    item: str | None = None,
) -> Any:
    """`torch.load(weights_only=True)`, with the classes in `allowed` allowlisted; a file that
    holds anything else is refused with `UnsafeCheckpointError` naming `what` (default: the
    file) and carrying `item`."""
    import torch

    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = next(
            (line.strip() for line in str(exc).splitlines() if "global" in line.lower()),
            "pickled code",
        )
        raise _refused(what or str(source), found, item) from None


# Globals the frameworks' own weights-only loads allow beside tensors, as `module.name`: the
# NumPy RNG state in the Hugging Face Trainer's `rng_state*.pth` (transformers' `safe_globals`)
# and DeepSpeed's optimizer files (`_DEEPSPEED_CLASSES`, allowlisted by `install_deepspeed`).
ALLOWED_GLOBALS = frozenset(
    {
        "numpy.ndarray",
        "numpy.dtype",
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray._reconstruct",
        "numpy.dtypes.UInt32DType",
        *(target.replace(":", ".") for target in _DEEPSPEED_CLASSES),
    }
)
TORCH_FILE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
# The Trainer's copy of its arguments: a pickled object, written with each checkpoint and never
# read back (a resume takes the arguments of the run that resumes).
NEVER_READ = frozenset({"training_args.bin"})


def check_checkpoint(folder: Path) -> None:
    """Refuse, naming it, any file in the checkpoint `folder` (subfolders included) that holds
    more than data: DCP `.metadata` beyond DCP's metadata classes, `torch.save` files
    (`TORCH_FILE_SUFFIXES`) with globals beyond tensors, containers and `ALLOWED_GLOBALS`,
    JSON files that are not JSON.

    Nothing in a file runs: `.metadata` is read by the restricted unpickler, and `torch.save`
    files are disassembled, not loaded (torch's `get_unsafe_globals_in_checkpoint`). Call it
    before handing a checkpoint to a framework, whose own loads refuse such files too (weights
    only, or `install`'s patches) but without naming the file.

    Raises:
        UnsafeCheckpointError: naming the first such file.
    """
    import torch

    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        if path.name.endswith(".metadata"):
            with path.open("rb") as stream:
                load_metadata(stream, str(path))
        elif path.suffix in TORCH_FILE_SUFFIXES and path.name not in NEVER_READ:
            try:
                found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            except (ValueError, RuntimeError, pickle.UnpicklingError) as exc:
                raise _refused(str(path), f"no torch.save data ({exc})") from None
            if unsafe := sorted(set(found) - ALLOWED_GLOBALS):
                raise _refused(str(path), f"the globals {unsafe}")
        elif path.suffix == ".json":
            try:
                json.loads(path.read_bytes())
            except (ValueError, UnicodeDecodeError):
                raise _refused(str(path), "something other than JSON") from None


def _deepspeed_classes() -> list[Any]:
    import importlib

    classes = []
    for target in _DEEPSPEED_CLASSES:
        module, _, name = target.partition(":")
        classes.append(getattr(importlib.import_module(module), name))
    return classes


_installed = False
_lock = threading.Lock()


def install() -> None:
    """Have DCP refuse pickled code in checkpoints in this process (and DeepSpeed, if it is
    imported already); once, whoever calls it first."""
    global _installed
    with _lock:
        if not _installed:
            _install_dcp()
            _installed = True
    if "deepspeed" in sys.modules:
        install_deepspeed()


def _install_dcp() -> None:
    from torch.distributed.checkpoint import default_planner, filesystem
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta

    def make_read_metadata(original: Any) -> Any:
        def read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = load_metadata(stream, str(path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        return read_metadata

    def make_read_data(original: Any) -> Any:
        def read_data(self: Any, plan: Any, planner: Any) -> Any:
            try:
                return original(self, plan, planner)
            except UnsafeCheckpointError as exc:
                if exc.item is None:
                    raise
                # The planner knows the entry, the reader its file.
                files = {
                    str(Path(self.path) / self.storage_data[item.storage_index].relative_path)
                    for item in plan.items
                    if item.storage_index.fqn == exc.item
                }
                raise UnsafeCheckpointError(f"{', '.join(sorted(files))}, entry {exc}") from None

        return read_data

    def make_load_bytes(original: Any) -> Any:
        def load_bytes(self: Any, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            loaded = torch_load(value, what=fqn, item=fqn)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

        return load_bytes

    replace(READ_METADATA, filesystem.FileSystemReader, "read_metadata", make_read_metadata)
    replace(READ_DATA, filesystem.FileSystemReader, "read_data", make_read_data)
    replace(LOAD_BYTES, default_planner.DefaultLoadPlanner, "load_bytes", make_load_bytes)


_deepspeed_installed = False


def install_deepspeed() -> None:
    """Have DeepSpeed refuse pickled code in its checkpoints in this process; once. Call it
    where DeepSpeed is about to be used (it imports DeepSpeed)."""
    global _deepspeed_installed
    with _lock:
        if _deepspeed_installed:
            return
        _deepspeed_installed = True
    from deepspeed.runtime.checkpoint_engine import torch_checkpoint_engine

    check(DEEPSPEED_LOAD)
    classes = _deepspeed_classes()

    def make_load(original: Any) -> Any:
        def load(self: Any, path: str, map_location: Any = None) -> Any:
            return torch_load(path, map_location=map_location, allowed=classes)

        return load

    replace(DEEPSPEED_LOAD, torch_checkpoint_engine.TorchCheckpointEngine, "load", make_load)
