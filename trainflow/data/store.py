"""Publishing prepared datasets so a crash never leaves one that looks finished.

Layout of a published dataset `<root>/<name>-<hash>/`:

    manifest.json        written last: its presence (with the right fingerprint) means complete
    <split>/index.json   one MDS dataset per split
    <split>/shard.*.mds[.zstd]

Local roots: everything is written into a hidden sibling temp directory, then renamed into place
with one `os.replace` (atomic on one filesystem). Object storage (`s3://`) has no rename, so
shards are uploaded by `streaming`'s own uploader to the final prefix and `manifest.json` is
uploaded last; readers and the cache only trust a prefix with a manifest.

A local dataset is trusted only while it is whole: a manifest that parses, each split's index,
every shard the index lists at its size, and no `DAMAGED` note (left by a reader that found a
shard whose hash does not match). One that is not is rebuilt: the new copy is staged as
always, the damaged folder is renamed aside and the new one renamed into its place.
"""

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from trainflow.data.errors import DataError
from trainflow.data.paths import is_remote, join_uri

MANIFEST = "manifest.json"
# Written into a local published dataset by a reader that found a damaged shard in it.
DAMAGED = "DAMAGED"
# 2: chat templates with `{% generation %}` blocks mark answers by them; splits may be in parts.
FORMAT_VERSION = 2

# A local path, or (local scratch path, remote URI) for object storage.
Out = str | tuple[str, str]

logger = logging.getLogger(__name__)


def check_writable(root: str) -> None:
    """Fail early, naming the path, if a local output root cannot be written.

    Raises:
        DataError: If the directory cannot be created or a file cannot be written in it.
    """
    if is_remote(root):
        return
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".write-check-"):
            pass
    except OSError as err:
        raise DataError(f"output_root {root} is not writable: {err}") from err


def _is_missing(err: Exception) -> bool:
    if isinstance(err, FileNotFoundError):
        return True
    response = getattr(err, "response", None)  # botocore ClientError
    code = str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
    return code in {"404", "NoSuchKey", "NoSuchBucket", "403"}


def read_manifest(uri: str) -> dict[str, Any] | None:
    """The manifest of a published dataset, or None when `uri` holds no complete dataset."""
    if not is_remote(uri):
        path = Path(uri) / MANIFEST
        if not path.is_file():
            return None
        try:
            manifest = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            logger.warning("%s is damaged (%s); the dataset will be rebuilt", path, err)
            return None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("splits"), dict):
            logger.warning("%s is not a manifest; the dataset will be rebuilt", path)
            return None
        return manifest
    from streaming.base.storage import CloudDownloader  # imports torch: only for remote stores

    with tempfile.TemporaryDirectory() as scratch:
        local = os.path.join(scratch, MANIFEST)
        try:
            CloudDownloader.direct_download(join_uri(uri, MANIFEST), local)
        except Exception as err:  # storage clients raise their own not-found errors
            if _is_missing(err):
                return None
            raise
        return json.loads(Path(local).read_text())


def read_index(uri: str, split: str) -> bytes | None:
    """The published `index.json` of one split, as bytes, or None when there is none."""
    name = f"{split}/index.json"
    if not is_remote(uri):
        path = Path(uri) / name
        return path.read_bytes() if path.is_file() else None
    from streaming.base.storage import CloudDownloader

    with tempfile.TemporaryDirectory() as scratch:
        local = os.path.join(scratch, "index.json")
        try:
            CloudDownloader.direct_download(join_uri(uri, name), local)
        except Exception as err:  # storage clients raise their own not-found errors
            if _is_missing(err):
                return None
            raise
        return Path(local).read_bytes()


def damage(uri: str, manifest: dict[str, Any]) -> str | None:
    """What is wrong with the local published dataset at `uri`, naming the file; None if whole.

    Cheap (a stat per shard, no hashing): a `DAMAGED` note left by a reader, a split's index
    missing or unreadable, or a shard the index lists missing or of another size. A dataset
    in object storage is not checked here (its reader checks each shard's hash).
    """
    if is_remote(uri):
        return None
    root = Path(uri)
    note = root / DAMAGED
    if note.is_file():
        return note.read_text(errors="replace").strip() or f"{note} marks it damaged"
    for split in manifest["splits"]:
        index = root / split / "index.json"
        try:
            shards = json.loads(index.read_text())["shards"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
            return f"{index} is missing or unreadable ({err})"
        for shard in shards:
            info = shard.get("zip_data") or shard.get("raw_data") or {}
            if "basename" not in info:
                return f"{index} lists a shard without a file"
            path = root / split / info["basename"]
            if not path.is_file():
                return f"{path} is missing"
            if path.stat().st_size != info["bytes"]:
                return f"{path} is {path.stat().st_size} bytes; its index says {info['bytes']}"
    return None


def mark_damaged(uri: str, reason: str) -> None:
    """Note in the local published dataset at `uri` that it is damaged, so the next prepare
    rebuilds it instead of handing it out again (a no-op for object storage)."""
    if is_remote(uri) or not Path(uri).is_dir():
        return
    note = Path(uri) / DAMAGED
    temp = note.with_name(f".{DAMAGED}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        temp.write_text(reason + "\n")
        os.replace(temp, note)
    except OSError as err:  # a read-only dataset: the reader's error still names the shard
        logger.warning("could not mark %s damaged: %s", uri, err)
        temp.unlink(missing_ok=True)


def _replace_damaged(staging: Path, final: Path) -> None:
    """Publish `staging` as `final`, where a damaged (or unfinished) dataset is in the way.

    The old folder is renamed aside first, then `staging` renamed into place; between the
    two renames `final` is missing, which readers take as "not published", never as whole.
    """
    # Named like a staging folder, so a later run removes it if this process dies before it does.
    aside = final.parent / (
        f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}-old"
    )
    with contextlib.suppress(FileNotFoundError):  # another run moved it first
        os.rename(final, aside)
    try:
        os.replace(staging, final)
    except OSError:
        # Another run published the same content in between; keep theirs.
        if read_manifest(str(final)) is None:
            raise
        logger.info("%s was rebuilt concurrently; discarding this copy", final)
    shutil.rmtree(aside, ignore_errors=True)


def _remove_stale_temps(final: Path) -> None:
    """Delete temp directories of earlier attempts on this host whose process has died."""
    prefix = f".{final.name}.tmp-{socket.gethostname()}-"
    for candidate in final.parent.glob(prefix + "*"):
        pid = candidate.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            logger.info("removing %s left by a crashed run (pid %s)", candidate, pid)
            shutil.rmtree(candidate, ignore_errors=True)


class Publication:
    """Where a dataset being prepared is written before it is published."""

    def __init__(self, uri: str, staging: Path) -> None:
        self.uri = uri
        self.staging = staging

    def out(self, split: str, *parts: str) -> Out:
        """Where a split (or a path under it) is written: a local path, or (scratch, remote).

        The form `MDSWriter`'s and `merge_index`'s `out` take.
        """
        local = str(self.staging.joinpath(split, *parts))
        return (local, join_uri(self.uri, split, *parts)) if is_remote(self.uri) else local

    def local_split_dir(self, split: str) -> Path:
        """Local directory holding the split's index and shards after writing."""
        return self.staging / split


@contextmanager
def publishing(uri: str, manifest: dict[str, Any]) -> Iterator[Publication]:
    """Stage a dataset, then publish it with `manifest` only if the block completes.

    Args:
        uri: Final dataset location (local path or `s3://` URI).
        manifest: Manifest to publish; the block may add to it before it ends.

    Yields:
        The publication to write splits into.
    """
    if is_remote(uri):
        scratch = Path(tempfile.mkdtemp(prefix="trainflow-publish-"))
        try:
            yield Publication(uri, scratch)
            (scratch / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
            from streaming.base.storage.upload import CloudUploader

            uploader = CloudUploader.get((str(scratch), uri), keep_local=True, exist_ok=True)
            uploader.upload_file(MANIFEST)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return

    final = Path(uri)
    _remove_stale_temps(final)
    staging = (
        final.parent
        / f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    staging.mkdir(parents=True)
    try:
        yield Publication(uri, staging)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        try:
            os.replace(staging, final)
        except OSError:
            published = read_manifest(uri)
            if published is None or damage(uri, published) is not None:
                logger.warning("replacing the damaged dataset at %s", uri)
                _replace_damaged(staging, final)
            else:  # another run published the same content first; keep theirs
                logger.info("%s was published concurrently; discarding this copy", uri)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
