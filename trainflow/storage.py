"""A run's folder kept in object storage (S3, GCS, Azure) through fsspec, by configuration alone.

    <output_root>/<pipeline>/<run_id>/config.json              uploaded when the run starts
    <output_root>/<pipeline>/<run_id>/checkpoints/step_000100/ each complete checkpoint, its
                                                               `meta.json` uploaded last

The local run folder stays the working copy: ranks write and read checkpoints there
(`trainflow.checkpoint`). Once rank 0 has published a complete checkpoint it uploads it
(`mirror_checkpoint`), the marker last, so a checkpoint in the bucket without one (an upload
cut short) is never downloaded, then deletes the bucket's checkpoints beyond the newest
`keep_checkpoints`. A resume on a machine without the local folder reads the config from the
bucket (`read_run_config`) and downloads the newest complete checkpoint into the local folder
before the ranks start (`open_run`).

Credentials and endpoints come from the environment, as each fsspec implementation reads them
(s3fs: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, and `S3_ENDPOINT_URL` or
`AWS_ENDPOINT_URL` for an S3-compatible server; gcsfs: `GOOGLE_APPLICATION_CREDENTIALS`;
adlfs: `AZURE_STORAGE_ACCOUNT_NAME` with a key, connection string or service principal).
"""

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from trainflow import checkpoint, paths
from trainflow.data.paths import is_remote, join_uri
from trainflow.paths import RUN_CONFIG_FILE

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

# In a local checkpoints folder: where rank 0 uploads each complete checkpoint written there.
MIRROR_FILE = ".mirror.json"
CHECKPOINTS = "checkpoints"
# Schemes whose clients read an S3-compatible endpoint from the environment.
_S3_SCHEMES = ("s3", "s3a")


class Mirror(BaseModel):
    """Where a local checkpoints folder is copied to, and how many checkpoints stay there."""

    model_config = ConfigDict(extra="forbid")

    uri: str = Field(description="Folder in object storage the checkpoints are uploaded under.")
    keep: int = Field(ge=1, description="Complete checkpoints kept there; older are deleted.")


def check_output_root(root: str) -> None:
    """Refuse an `output_root` this machine cannot write to, before anything starts.

    A local folder is always accepted; a URI must name a scheme fsspec knows, whose
    implementation is installed here, and a bucket.

    Raises:
        ValueError: naming `output_root`, and the package to install when one is missing.
    """
    if not is_remote(root):
        return
    from fsspec import get_filesystem_class
    from fsspec.registry import known_implementations, registry

    scheme, _, rest = root.partition("://")
    if scheme not in known_implementations and scheme not in registry:
        raise ValueError(
            f"output_root {root!r}: unknown scheme {scheme!r}; give a local folder or an "
            "object storage URI such as s3://bucket/prefix, gs://bucket/prefix or "
            "az://container/prefix"
        )
    try:
        get_filesystem_class(scheme)
    except ImportError:
        known = known_implementations.get(scheme, {})
        package = str(known.get("class", "")).split(".")[0]
        need = (
            f"the {package} package: pip install {package}"
            if package and package != "fsspec"
            else str(known.get("err", "its client library"))
        )
        raise ValueError(f"output_root {root!r}: {scheme}:// needs {need}") from None
    if not rest.strip("/"):
        raise ValueError(f"output_root {root!r} names no bucket: give {scheme}://bucket/prefix")


def local_run_dir(pipeline: str, run_id: str, output_root: str | None) -> Path:
    """The run's local folder: under `output_root` when that is a local folder, else under
    TRAINFLOW_HOME (the working copy of a run kept in object storage)."""
    return paths.run_output_dir(pipeline, run_id, _local_root(output_root))


def _local_root(output_root: str | None) -> str | None:
    """The folder local run folders are kept under (None: TRAINFLOW_HOME's)."""
    return None if output_root is None or is_remote(output_root) else output_root


def remote_run_uri(pipeline: str, run_id: str, output_root: str | None) -> str | None:
    """The run's folder in object storage (None: `output_root` is local or unset)."""
    if output_root is None or not is_remote(output_root):
        return None
    return join_uri(output_root, pipeline, run_id)


def read_run_config(pipeline: str, run_id: str, output_root: str | None = None) -> dict[str, Any]:
    """The config run `run_id` of `pipeline` was started with: from its local folder, else
    (a resume on another machine) from its folder in object storage.

    Raises:
        ValueError: no such run here nor under `output_root`, or it cannot be read there.
    """
    if output_root is not None:
        check_output_root(output_root)  # read before the config that holds it is validated
    local = local_run_dir(pipeline, run_id, output_root)
    remote = remote_run_uri(pipeline, run_id, output_root)
    if remote is None or (local / RUN_CONFIG_FILE).is_file():
        return paths.read_run_config(pipeline, run_id, _local_root(output_root))
    uri = join_uri(remote, RUN_CONFIG_FILE)
    fs, path = _filesystem(uri)
    try:
        data: dict[str, Any] = json.loads(fs.cat_file(path))
    except FileNotFoundError:
        raise ValueError(
            f"no {pipeline} run {run_id} here nor under output_root {output_root} "
            f"({uri} is missing)"
        ) from None
    except OSError as exc:
        raise ValueError(f"cannot read {uri}: {exc}") from None
    return data


def open_run(run_uri: str | None, local_dir: Path, keep: int) -> Path | None:
    """Tie the local run folder to its copy at `run_uri`, before the ranks start.

    The local `config.json` is uploaded (a new run) or, when missing (a resume on another
    machine), downloaded; the newest complete checkpoint in the bucket is downloaded when it
    is newer than the local ones; and the local checkpoints folder is marked so that rank 0
    uploads each checkpoint completed there (`mirror_checkpoint`). With no `run_uri` (a run
    kept locally, perhaps resumed with its `output_root` unset), the mark is removed.

    Returns:
        The checkpoint downloaded, if any.
    """
    if run_uri is None:
        (local_dir / CHECKPOINTS / MIRROR_FILE).unlink(missing_ok=True)
        return None
    config = local_dir / RUN_CONFIG_FILE
    fs, remote_config = _filesystem(join_uri(run_uri, RUN_CONFIG_FILE))
    if config.is_file():
        fs.put_file(str(config), remote_config)
    else:
        fs.get_file(remote_config, str(config))
    remote, local = join_uri(run_uri, CHECKPOINTS), local_dir / CHECKPOINTS
    local.mkdir(parents=True, exist_ok=True)
    downloaded = download_latest(remote, local)
    (local / MIRROR_FILE).write_text(Mirror(uri=remote, keep=keep).model_dump_json())
    return downloaded


def mirror_checkpoint(path: Path) -> None:
    """Upload the complete checkpoint at `path` where its folder is mirrored, if it is.

    Call on rank 0 only, once the checkpoint is published. The upload is synchronous: the
    other ranks wait for it at the next collective.
    """
    settings = path.parent / MIRROR_FILE
    if not settings.is_file():
        return
    mirror = Mirror.model_validate_json(settings.read_text())
    upload_checkpoint(path, mirror.uri, mirror.keep)


def upload_checkpoint(path: Path, remote_root: str, keep: int | None = None) -> str:
    """Copy the complete checkpoint folder `path` to `<remote_root>/<name>/`, `meta.json` last,
    then delete the complete ones there beyond the newest `keep` (None: keep all).

    A checkpoint of the same name already there (a resumed run reaching the step again) is
    replaced, its marker removed first so it is never whole and half old.

    Returns:
        The checkpoint's URI.
    """
    checkpoint.read_meta(path)  # only a complete checkpoint is uploaded
    fs, root = _filesystem(remote_root)
    dest = f"{root}/{path.name}"
    fs.invalidate_cache(root)
    if fs.exists(dest):
        _remove(fs, dest)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p != path / checkpoint.MARKER)
    if files:
        fs.put([str(p) for p in files], [f"{dest}/{p.relative_to(path).as_posix()}" for p in files])
    fs.put_file(str(path / checkpoint.MARKER), f"{dest}/{checkpoint.MARKER}")
    if keep is not None:
        prune_remote(remote_root, keep)
    return join_uri(remote_root, path.name)


def remote_checkpoints(remote_root: str) -> list[tuple[int, str]]:
    """(step, name) of the complete checkpoints under `remote_root`, oldest step first; a
    folder without `meta.json` (an upload cut short) is not one."""
    fs, root = _filesystem(remote_root)
    fs.invalidate_cache(root)
    done = []
    for marker in fs.glob(f"{root}/*/{checkpoint.MARKER}"):
        name = marker.rstrip("/").split("/")[-2]
        step = checkpoint.step_of(name)
        if step is not None:
            done.append((step, name))
    return sorted(done)


def prune_remote(remote_root: str, keep: int) -> list[str]:
    """Delete the complete checkpoints under `remote_root` beyond the newest `keep`, and the
    incomplete ones older than the newest complete one (uploads cut short); return their names.
    """
    done = remote_checkpoints(remote_root)
    if not done:
        return []
    fs, root = _filesystem(remote_root)
    names = {name for _, name in done}
    newest = done[-1][0]
    cut_short = [
        name
        for name in (p.rstrip("/").split("/")[-1] for p in fs.ls(root, detail=False))
        if name not in names and (step := checkpoint.step_of(name)) is not None and step < newest
    ]
    old = [name for _, name in done[:-keep]] + cut_short
    for name in old:
        _remove(fs, f"{root}/{name}")
    return old


def download_latest(remote_root: str, local_root: Path) -> Path | None:
    """Download the newest complete checkpoint under `remote_root` into `local_root`, unless a
    local one is as new; return the checkpoint downloaded (None: none was).

    The files land in a partial folder, the marker last, which one rename publishes: a
    download cut short leaves nothing a resume would read (`checkpoint.remove_partial`).
    """
    done = remote_checkpoints(remote_root)
    if not done:
        return None
    step, name = done[-1]
    latest = checkpoint.latest_checkpoint(local_root)
    if latest is not None and checkpoint.read_meta(latest)["step"] >= step:
        return None
    fs, root = _filesystem(remote_root)
    source, path = f"{root}/{name}", local_root / name
    partial = checkpoint.partial_path(path)
    shutil.rmtree(partial, ignore_errors=True)
    keys = [k for k in fs.find(source) if k != f"{source}/{checkpoint.MARKER}"]
    targets = [partial / k.removeprefix(f"{source}/") for k in keys]
    for target in {t.parent for t in targets} | {partial}:
        target.mkdir(parents=True, exist_ok=True)
    if keys:
        fs.get(keys, [str(t) for t in targets])
    fs.get_file(f"{source}/{checkpoint.MARKER}", str(partial / checkpoint.MARKER))
    if path.exists():
        shutil.rmtree(path)
    os.replace(partial, path)
    return path


def _remove(fs: "AbstractFileSystem", folder: str) -> None:
    """Delete a checkpoint folder in object storage, its marker first."""
    marker = f"{folder}/{checkpoint.MARKER}"
    if fs.exists(marker):
        fs.rm_file(marker)
    if fs.exists(folder):
        fs.rm(folder, recursive=True)


def _filesystem(uri: str) -> tuple["AbstractFileSystem", str]:
    """The fsspec filesystem of `uri` and the path inside it; an S3-compatible endpoint in
    `S3_ENDPOINT_URL` or `AWS_ENDPOINT_URL` is passed to s3fs."""
    from fsspec.core import url_to_fs

    options: dict[str, Any] = {}
    endpoint = os.environ.get("S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and uri.partition("://")[0] in _S3_SCHEMES:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    fs, path = url_to_fs(uri, **options)
    return fs, path.rstrip("/")
