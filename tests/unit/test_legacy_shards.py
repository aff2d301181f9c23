"""Shards that mosaicml-streaming 0.13 wrote read back as exactly the rows it was given, in order.

`tests/data/mds-0.13/` was written once by `scripts/make_legacy_shards.py` under
mosaicml-streaming 0.13 (trainflow's column sets: SFT tokens, two-tower clicks, every tabular
scalar type, detection images; zstd and uncompressed, with and without sha1) and is never
written again by a later `streaming`: it is how a later one (streaming-community) shows that it
still reads what trainflow published before. `expected.json` holds every row as plain JSON, so
the comparison does not depend on `streaming`.

Every way trainflow reads MDS is used: `StreamingDataset` over the files, `LocalDataset` in
place (uncompressed datasets, as the detection reader does), `build_dataloader` (streaming's
sha1 check on the way into its cache, then trainflow's own check of the cached files against
the published index) and the detection reader. The reads run on copies, in a child process:
readers write decompressed shards and caches beside what they read, and streaming releases its
shared memory only when the process exits (the test checks it did). Streaming leaves its lock
files in the temp folder even then: the child removes its own before it exits.
"""

import gc
import hashlib
import importlib.util
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
LEGACY = REPO_ROOT / "tests" / "data" / "mds-0.13"
SCRIPT = REPO_ROOT / "scripts" / "make_legacy_shards.py"
SHM = Path("/dev/shm")
STREAMING_DATASET = ("StreamingDataset iterated", "StreamingDataset[i]")
LOADER = ("build_dataloader", "build_dataloader again, from its cache")


def _expected() -> dict[str, Any]:
    return json.loads((LEGACY / "expected.json").read_text())


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {
        p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _prefixes_naming(folder: Path) -> set[str]:
    """Prefixes of the shared memory streaming registered for local folders under `folder`
    (its `<prefix>_locals` holds the folders), while that memory exists."""
    found = set()
    for path in SHM.glob("*_locals"):
        try:
            if str(folder).encode() in path.read_bytes():
                found.add(path.name.split("_")[0])
        except OSError:  # another user's, or just unlinked
            continue
    return found


def _remove_lock_files(prefixes: set[str]) -> list[str]:
    """Remove streaming's lock files of `prefixes`. Call while this process still maps their
    shared memory: no other run takes a prefix whose memory exists, so the files are ours."""
    removed = []
    for prefix in sorted(prefixes):
        for lock in ("barrier", "cache"):
            path = Path(tempfile.gettempdir()) / f"{prefix}_{lock}_filelock"
            if path.exists():
                path.unlink()
                removed.append(path.name)
    return removed


def read_every_way(root: str, out: str) -> None:
    """Read every split under `root`/plain and `root`/published each way trainflow reads MDS,
    and pickle what came back to `out`. Runs in a child process of the test."""
    prefixes: set[str] = set()
    try:
        reads = _read_datasets(Path(root), prefixes)
    finally:
        lock_files = _remove_lock_files(prefixes)
    reads["shared memory"] = {"prefixes": sorted(prefixes), "lock files": lock_files}
    with open(out, "wb") as file:
        pickle.dump(reads, file)


def _read_datasets(root: Path, prefixes: set[str]) -> dict[str, Any]:
    """What each reader returns for each split; adds the shared memory prefixes it opened."""
    from streaming import LocalDataset, StreamingDataset

    from trainflow.data import LoaderConfig, build_dataloader
    from trainflow.data.loader import verify_cached_split
    from trainflow.data.paths import stream_cache_dir

    reads: dict[str, Any] = {}
    in_order = LoaderConfig(batch_size=4, shuffle=False)
    for manifest_path in sorted((root / "published").glob("*/manifest.json")):
        name, uri = manifest_path.parent.name, str(manifest_path.parent)
        manifest = json.loads(manifest_path.read_text())
        for split in manifest["splits"]:
            rows: dict[str, list[Any]] = {}
            local = str(root / "plain" / name / split)
            dataset = StreamingDataset(local=local, batch_size=1, shuffle=False)
            prefixes |= _prefixes_naming(root)
            rows[STREAMING_DATASET[0]] = list(dataset)
            rows[STREAMING_DATASET[1]] = [dataset[i] for i in range(len(dataset))]
            del dataset
            gc.collect()  # streaming allows one open dataset per local folder
            if manifest["compression"] is None:
                in_place = LocalDataset(local=uri, split=split)
                rows["LocalDataset[i]"] = [in_place[i] for i in range(len(in_place))]
            cache = stream_cache_dir(uri)
            removed: list[str] = []
            for way in LOADER:  # the second build finds the first one's cached copies
                loader = build_dataloader(uri, split, in_order, collate_fn=list)
                prefixes |= _prefixes_naming(root)
                rows[way] = [sample for batch in loader for sample in batch]
                del loader
                gc.collect()
                removed += verify_cached_split(uri, split, cache, manifest["hashes"])
            cached = sorted(
                p.relative_to(cache / split).as_posix()
                for p in (cache / split).rglob("*")
                if p.is_file()
            )
            reads[f"{name}/{split}"] = {"rows": rows, "removed": removed, "cached": cached}
            if "image" in manifest["columns"]:
                reads[f"{name}/{split}"]["detection"] = _read_detection(uri, split)
    return reads


def _read_detection(uri: str, split: str) -> list[dict[str, Any]]:
    """The detection workload's reader: decoded pixels (as their sha256), boxes and labels."""
    import torch

    from trainflow.workloads.detection import read_split

    images = []
    for image, target in read_split(uri, split):
        pixels = (image * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
        images.append(
            {
                "shape": list(pixels.shape),
                "sha256": hashlib.sha256(pixels.tobytes()).hexdigest(),
                "boxes": target["boxes"].numpy(),
                "labels": target["labels"].numpy(),
            }
        )
    return images


def _same(value: Any, written: Any, encoding: str) -> bool:
    """Whether a value read is exactly the written one, type included."""
    if encoding.startswith("ndarray:"):
        dtype = np.dtype(encoding.removeprefix("ndarray:"))
        return (
            isinstance(value, np.ndarray)
            and value.dtype == dtype
            and value.ndim == 1
            and value.tolist() == written
        )
    if encoding == "bytes":
        return isinstance(value, bytes) and value.hex() == written
    if encoding == "str":
        return isinstance(value, str) and value == written
    if encoding == "json":  # 1 and 1.0, or a list and a tuple, differ in JSON
        return json.dumps(value, sort_keys=True) == json.dumps(written, sort_keys=True)
    return (
        isinstance(value, np.generic)
        and value.dtype == np.dtype(encoding)
        and type(value.item()) is type(written)
        and value.item() == written
    )


def _differences(rows: list[Any], written: list[Any], columns: dict[str, str]) -> list[str]:
    found = [f"{len(rows)} rows read, {len(written)} written"] if len(rows) != len(written) else []
    for i, (row, want) in enumerate(zip(rows, written, strict=False)):
        if set(row) != set(columns):
            found.append(f"row {i}: columns {sorted(row)}, written {sorted(columns)}")
        found += [
            f"row {i}, {column} ({encoding}): read {row[column]!r}, written {want[column]!r}"
            for column, encoding in columns.items()
            if column in row and not _same(row[column], want[column], encoding)
        ]
    return found


def _detection_differences(images: list[dict[str, Any]], written: dict[str, Any]) -> list[str]:
    found = []
    if len(images) != len(written["rows"]):
        found.append(f"{len(images)} images read, {len(written['rows'])} written")
    for i, (image, row, pixels) in enumerate(
        zip(images, written["rows"], written["pixels"], strict=False)
    ):
        if {"shape": image["shape"], "sha256": image["sha256"]} != pixels:
            found.append(f"image {i}: decoded pixels differ from the written image's")
        if image["boxes"].tolist() != np.reshape(row["boxes"], (-1, 4)).tolist():
            found.append(f"image {i}: boxes {image['boxes'].tolist()}, written {row['boxes']}")
        if image["labels"].tolist() != row["labels"]:
            found.append(f"image {i}: labels {image['labels'].tolist()}, written {row['labels']}")
    return found


def _read_in_a_child(root: Path) -> dict[str, Any]:
    out = root / "reads.pickle"
    env = {**os.environ, "TRAINFLOW_HOME": str(root / "home")}
    code = f"from {__name__} import read_every_way as f; f({str(root)!r}, {str(out)!r})"
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = child.communicate(timeout=400)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode == 0, output[-6000:]
    with open(out, "rb") as file:
        return pickle.load(file)


def test_the_shipped_files_are_what_expected_json_describes():
    """The reading test compares against expected.json: it must cover every dataset, split,
    shard and row shipped, and say that 0.13 wrote them."""
    expected = _expected()
    assert expected["written_with"]["mosaicml-streaming"].startswith("0.13.")
    shipped = {p.parent.name for p in LEGACY.glob("*/manifest.json")}
    assert shipped == set(expected["datasets"]) and len(shipped) >= 4
    named = {"README.md", "expected.json"}
    for name, written in expected["datasets"].items():
        manifest = json.loads((LEGACY / name / "manifest.json").read_text())
        named.add(f"{name}/manifest.json")
        assert manifest["columns"] == written["columns"], name
        assert manifest["compression"] == written["compression"], name
        assert manifest["hashes"] == written["hashes"], name
        assert set(manifest["splits"]) == set(written["splits"]), name
        for split, rows in written["splits"].items():
            index = json.loads((LEGACY / name / split / "index.json").read_text())
            shards = index["shards"]
            assert len(shards) >= 2, f"{name}/{split} should span several shards"
            assert sum(s["samples"] for s in shards) == len(rows) > 0, f"{name}/{split}"
            assert manifest["splits"][split]["num_samples"] == len(rows), f"{name}/{split}"
            for shard in shards:
                encodings = dict(zip(shard["column_names"], shard["column_encodings"], strict=True))
                assert encodings == written["columns"], f"{name}/{split}"
                data = shard["zip_data"] or shard["raw_data"]
                named.add(f"{name}/{split}/{data['basename']}")
            named.add(f"{name}/{split}/index.json")
            named.update(
                f"{name}/{split}/{p.relative_to(LEGACY / name / split).as_posix()}"
                for p in (LEGACY / name / split).glob("part-*/index.json")
            )
    assert {"zstd", None} <= {d["compression"] for d in expected["datasets"].values()}
    assert set(_listing(LEGACY)) == named


@pytest.mark.slow  # a child process that imports torch, streaming and torchvision
def test_every_row_written_by_0_13_reads_back_exactly_in_order(tmp_path):
    expected = _expected()
    before = _listing(LEGACY)
    shutil.copytree(LEGACY, tmp_path / "plain")
    shutil.copytree(LEGACY, tmp_path / "published")

    reads = _read_in_a_child(tmp_path)
    shared_memory = reads.pop("shared memory")

    differences = []
    for name, written in expected["datasets"].items():
        columns = written["columns"]
        for split, rows in written["splits"].items():
            where = f"{name}/{split}"
            read = reads.pop(where)
            ways = set(STREAMING_DATASET + LOADER)
            if written["compression"] is None:
                ways.add("LocalDataset[i]")
            assert set(read["rows"]) == ways, where
            for way, got in read["rows"].items():
                differences += [f"{where}, {way}: {d}" for d in _differences(got, rows, columns)]
            # Intact cached copies are kept; a hash or size that disagreed would remove them.
            assert read["removed"] == [], f"{where}: cached files failed their check"
            index = json.loads((LEGACY / name / split / "index.json").read_text())
            raw = [s["raw_data"]["basename"] for s in index["shards"]]
            assert set(raw) <= set(read["cached"]), f"{where}: {read['cached']}"
            if "pixels" in written:
                detection = {"rows": rows, "pixels": written["pixels"][split]}
                differences += [
                    f"{where}, detection reader: {d}"
                    for d in _detection_differences(read["detection"], detection)
                ]
    assert reads == {}, f"read splits expected.json does not have: {sorted(reads)}"
    assert differences == [], "\n".join(differences[:40])
    assert _listing(LEGACY) == before, "the shipped files changed while they were read"
    if SHM.is_dir():
        # Found while the datasets were open: else the check below would look for nothing.
        assert shared_memory["prefixes"], "the reader's shared memory was not found in /dev/shm"
        assert _prefixes_naming(tmp_path) == set(), "streaming's shared memory outlived the reader"


def test_the_script_refuses_any_other_streaming(monkeypatch):
    spec = importlib.util.spec_from_file_location("make_legacy_shards", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for providers, installed in (
        (["streaming-community"], "0.13.0"),
        (["mosaicml-streaming"], "0.14.0"),
        (["mosaicml-streaming", "streaming-community"], "0.13.0"),
        ([], "0.13.0"),
    ):
        monkeypatch.setattr(script, "packages_distributions", lambda p=providers: {"streaming": p})
        monkeypatch.setattr(script, "version", lambda name, v=installed: v)
        with pytest.raises(SystemExit, match=r"refusing to write: .* mosaicml-streaming 0\.13\.x"):
            script.require_writer()
    monkeypatch.setattr(script, "packages_distributions", lambda: {"streaming": [script.WRITER]})
    monkeypatch.setattr(script, "version", lambda name: "0.13.0")
    assert script.require_writer()["mosaicml-streaming"] == "0.13.0"
