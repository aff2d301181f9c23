"""Write tiny MDS datasets with mosaicml-streaming 0.13, the way trainflow writes them, so that a
later `streaming` (streaming-community) is tested against shards the old writer made.

    .venv/bin/python scripts/make_legacy_shards.py        # rewrites tests/data/mds-0.13/

It refuses to run unless the installed `streaming` comes from mosaicml-streaming 0.13.x: the
point of the files is that 0.13 wrote them. The committed files were written on 2026-12-06 by
that command with Python 3.11.7, mosaicml-streaming 0.13.0, numpy 2.1.3, zstd 1.5.7.2 and
pillow 13.0.0 (the script prints its versions and writes them into the folder's README.md and
expected.json).

What it writes under the output folder, one published dataset per folder (the layout
`prepare_dataset` publishes, so `build_dataloader` opens each one as it opens its own):

- `instructions/`: the SFT chat columns (`id` int64, `input_ids` ndarray:int32,
  `assistant_masks` ndarray:uint8, `turns` json, `task` str), zstd, sha1; `train` written in
  two parts by two writers and joined by `merge_index`, as parallel conversion writes it.
- `interactions/`: the two-tower columns (`id`, `user_id`, `item_id`, `item_category` int64,
  `clicked` float32), zstd, sha1; `train`, `validation` and `test` split by id.
- `scalars/`: `id` and one column of every scalar type a tabular transform may declare (int8 to
  uint64, float16 to float64, str), holding each type's extremes; uncompressed, no hashes.
- `shapes/`: the detection columns (`id` int64, `image` bytes holding a PNG, `boxes`
  ndarray:float32, `labels` ndarray:int64) from the shapes generator; uncompressed, sha1.

Every split has at least two shards (small `size_limit`s). Beside them:

- `expected.json`: every row of every split, in order, as plain JSON, so that the reader test
  compares exact values without `streaming`: ndarrays as lists (the dtype is the column's
  encoding), bytes as hex, scalars as numbers, json columns as they are; for `shapes`, also the
  sha256 and shape of each image's decoded pixels.
- `README.md`: what is here, the command, the versions and the date.

The rows are synthetic and drawn from fixed seeds: with the same package versions the shards
come out byte for byte the same.
"""

import argparse
import datetime
import hashlib
import json
import platform
import shutil
import sys
from importlib.metadata import packages_distributions, version
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "tests" / "data" / "mds-0.13"
COMMAND = ".venv/bin/python scripts/make_legacy_shards.py"
WRITER = "mosaicml-streaming"
WRITER_SERIES = "0.13."
# Packages whose versions decide the bytes written (zstd compresses, pillow encodes the PNGs).
RECORDED = (WRITER, "numpy", "zstd", "pillow")
BOS, EOS = 1, 2
TASKS = ("reverse", "add", "next", "upper")
SCALAR_TYPES = (
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
)
STRINGS = ("", "plain", "ünïcødé", "emoji 🚀", "line\nbreak\ttab", 'quote " \\', "nul\x00inside")


def require_writer() -> dict[str, str]:
    """The versions this run writes with; exits unless `streaming` is mosaicml-streaming 0.13.x.

    Checked before `streaming` is imported, from the installed distributions' metadata.
    """
    providers = sorted(set(packages_distributions().get("streaming", [])))
    if providers != [WRITER] or not version(WRITER).startswith(WRITER_SERIES):
        found = ", ".join(f"{name} {version(name)}" for name in providers) or "nothing"
        sys.exit(
            f"refusing to write: these shards must be written by {WRITER} {WRITER_SERIES}x, but "
            f"the installed `streaming` comes from {found}. Run this script in an environment "
            f"with `pip install '{WRITER}=={WRITER_SERIES}*'` only."
        )
    versions = {"python": platform.python_version()}
    versions.update({name: version(name) for name in RECORDED})
    return versions


def instructions_rows(rng: np.random.Generator, ids: range) -> list[dict[str, Any]]:
    """Chat rows as the chat transform writes them with `turns: true`: a BOS, then per turn a
    prompt (mask 0) and an answer ending in EOS (mask 1)."""
    rows = []
    for row_id in ids:
        input_ids, masks, turns = [BOS], [0], []
        for _ in range(int(rng.integers(1, 3))):
            prompt = rng.integers(3, 280, int(rng.integers(3, 9))).tolist()
            answer = rng.integers(3, 280, int(rng.integers(1, 4))).tolist() + [EOS]
            since = [BOS] if not turns else []  # tokens since the previous answer
            turns.append({"input_ids": since + prompt, "labels": answer})
            input_ids += prompt + answer
            masks += [0] * len(prompt) + [1] * len(answer)
        rows.append(
            {
                "id": np.int64(row_id),
                "input_ids": np.array(input_ids, dtype=np.int32),
                "assistant_masks": np.array(masks, dtype=np.uint8),
                "turns": turns,
                "task": TASKS[int(rng.integers(len(TASKS)))],
            }
        )
    return rows


def interactions_rows(rng: np.random.Generator, ids: range) -> list[dict[str, Any]]:
    """User-item clicks with the two-tower pipeline's column types."""
    rows = []
    for row_id in ids:
        item = int(rng.integers(100))
        rows.append(
            {
                "id": np.int64(row_id),
                "user_id": np.int64(rng.integers(200)),
                "item_id": np.int64(item),
                "item_category": np.int64(item % 8),
                "clicked": np.float32(rng.integers(2)),
            }
        )
    return rows


def scalars_rows(rng: np.random.Generator, num_rows: int) -> list[dict[str, Any]]:
    """Each scalar type's smallest and largest value (and the float types' smallest normal and
    subnormal magnitudes) in the first rows, then random values; strings that need care."""
    rows = []
    for i in range(num_rows):
        row: dict[str, Any] = {"id": np.int64(i)}
        for name in SCALAR_TYPES:
            dtype = np.dtype(name)
            limits = np.iinfo(dtype) if dtype.kind in "iu" else np.finfo(dtype)
            edges = [limits.min, limits.max]
            if dtype.kind == "f":
                edges += [limits.tiny, limits.smallest_subnormal, -limits.tiny]
            if i < len(edges):
                value = edges[i]
            elif dtype.kind == "f":
                value = rng.normal(0.0, 1000.0)
            else:
                value = rng.integers(limits.min, limits.max, endpoint=True, dtype=dtype)
            row[name] = dtype.type(value)
        row["str"] = STRINGS[i % len(STRINGS)] + ("" if i < len(STRINGS) else f" #{i}")
        rows.append(row)
    return rows


def shapes_rows(split_index: int, num_rows: int) -> list[dict[str, Any]]:
    """Tiny detection images from trainflow's generator, as the detection transform writes
    them: PNG bytes, flat float32 boxes, int64 labels."""
    from trainflow.data.shapes import ShapesSpec
    from trainflow.data.shapes import shapes_rows as generate

    spec = ShapesSpec(image_size=16, max_objects=2, min_object_size=4, max_object_size=8)
    return [
        {
            "id": np.int64(i),
            "image": row["image"],
            "boxes": np.array(row["boxes"], dtype=np.float32).reshape(-1),
            "labels": np.array(row["labels"], dtype=np.int64),
        }
        for i, row in enumerate(generate(spec, split_index, num_rows))
    ]


def datasets() -> dict[str, dict[str, Any]]:
    """Name -> columns, write options and rows per split, with trainflow's column sets."""
    from trainflow.data.transforms import DETECTION_COLUMNS

    chat = {
        "id": "int64",
        "input_ids": "ndarray:int32",
        "assistant_masks": "ndarray:uint8",
        "turns": "json",
        "task": "str",
    }
    tabular = {c: "int64" for c in ("id", "user_id", "item_id", "item_category")}
    tabular["clicked"] = "float32"
    rng = np.random.default_rng(0)
    return {
        "instructions": {
            "columns": chat,
            "compression": "zstd",
            "hashes": ["sha1"],
            "size_limit": 1024,
            "parts": {"train": 2},
            "splits": {
                "train": instructions_rows(rng, range(100, 124)),
                "validation": instructions_rows(rng, range(200, 206)),
            },
        },
        "interactions": {
            "columns": tabular,
            "compression": "zstd",
            "hashes": ["sha1"],
            "size_limit": 512,
            "splits": {
                "train": interactions_rows(rng, range(0, 24)),
                "validation": interactions_rows(rng, range(24, 30)),
                "test": interactions_rows(rng, range(30, 36)),
            },
        },
        "scalars": {
            "columns": {"id": "int64", **{t: t for t in SCALAR_TYPES}, "str": "str"},
            "compression": None,
            "hashes": [],
            "size_limit": 1024,
            "splits": {"train": scalars_rows(rng, 16)},
        },
        "shapes": {
            "columns": {"id": "int64", **DETECTION_COLUMNS},
            "compression": None,
            "hashes": ["sha1"],
            "size_limit": 2048,
            "splits": {"train": shapes_rows(0, 10), "validation": shapes_rows(1, 4)},
        },
    }


def write_split(folder: Path, spec: dict[str, Any], rows: list[dict[str, Any]], parts: int) -> None:
    """Write `rows` in order as one MDS dataset, in `parts` contiguous parts when > 1."""
    from streaming import MDSWriter
    from streaming.base.util import merge_index

    options = {k: spec[k] for k in ("compression", "hashes", "size_limit")}
    bounds = np.linspace(0, len(rows), parts + 1).astype(int)
    outs = [folder] if parts == 1 else [folder / f"part-{i:05d}" for i in range(parts)]
    for out, start, stop in zip(outs, bounds[:-1], bounds[1:], strict=True):
        with MDSWriter(
            out=str(out), columns=spec["columns"], keep_local=True, exist_ok=True, **options
        ) as writer:
            for row in rows[start:stop]:
                writer.write(row)
    if parts > 1:
        merge_index([str(out / "index.json") for out in outs], str(folder), keep_local=True)


def plain(value: Any, encoding: str) -> Any:
    """A written value as JSON: exact for every encoding trainflow writes."""
    if encoding.startswith("ndarray:"):
        return value.tolist()
    if encoding == "bytes":
        return value.hex()
    if encoding in ("str", "json"):
        return value
    return value.item()


def pixels(png: bytes) -> dict[str, Any]:
    """What a reader that decodes the PNG should get."""
    from trainflow.data.shapes import decode_png

    decoded = decode_png(png)
    return {"shape": list(decoded.shape), "sha256": hashlib.sha256(decoded.tobytes()).hexdigest()}


def split_bytes(folder: Path) -> int:
    """Bytes of a split's shards and index, as `prepare_dataset` counts them."""
    index = json.loads((folder / "index.json").read_text())
    data = sum((s["zip_data"] or s["raw_data"])["bytes"] for s in index["shards"])
    return data + (folder / "index.json").stat().st_size


def manifest(name: str, spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The manifest `prepare_dataset` writes (without its config: no source files made these);
    the fingerprint hashes the split indexes."""
    from trainflow.data.store import FORMAT_VERSION

    indexes = hashlib.sha256()
    for split in spec["splits"]:
        indexes.update((folder / split / "index.json").read_bytes())
    return {
        "format_version": FORMAT_VERSION,
        "name": name,
        "fingerprint": indexes.hexdigest(),
        "columns": spec["columns"],
        "hashes": spec["hashes"],
        "compression": spec["compression"],
        "splits": {
            split: {
                "num_samples": len(rows),
                "num_dropped": 0,
                "num_bytes": split_bytes(folder / split),
            }
            for split, rows in spec["splits"].items()
        },
    }


def readme(versions: dict[str, str], today: str) -> str:
    """The folder's README: what, how, with which versions, when."""
    listed = "\n".join(f"- {name} {v}" for name, v in versions.items())
    return f"""# MDS shards written by mosaicml-streaming 0.13

Tiny datasets written by `scripts/make_legacy_shards.py` with mosaicml-streaming 0.13, kept so
that every later `streaming` (streaming-community) is checked against shards the old writer
made. `tests/unit/test_legacy_shards.py` reads each split, from a copy, with `StreamingDataset`,
`LocalDataset` (uncompressed datasets), trainflow's `build_dataloader` (its sha1 checks of the
cached shards included) and the detection reader, and compares every row, in order, with
`expected.json`.

Each folder is one published dataset (`manifest.json`, `<split>/index.json`, shards):

- `instructions`: `id` int64, `input_ids` ndarray:int32, `assistant_masks` ndarray:uint8,
  `turns` json, `task` str; zstd, sha1; `train` in two parts joined by `merge_index`.
- `interactions`: `id`, `user_id`, `item_id`, `item_category` int64, `clicked` float32; zstd,
  sha1.
- `scalars`: `id` and one column of each of int8 ... uint64, float16 ... float64 and str,
  holding each type's extremes; uncompressed, no hashes.
- `shapes`: `id` int64, `image` bytes (PNG), `boxes` ndarray:float32, `labels` ndarray:int64;
  uncompressed, sha1.

Every split spans at least two shards.

`expected.json` holds every row as plain JSON: ndarrays as lists (the dtype is the column's
encoding), bytes as hex, scalars as numbers, json columns as they are, and for `shapes` the
shape and sha256 of each image's decoded pixels.

Do not edit these files by hand. To write them again (only ever with mosaicml-streaming 0.13.x,
which the script checks):

    {COMMAND}

Written on {today} with:

{listed}
"""


def write(out: Path, versions: dict[str, str], today: str) -> None:
    """Write every dataset, `expected.json` and `README.md` into a fresh `out`."""
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    expected: dict[str, Any] = {"written_with": versions, "written_on": today, "datasets": {}}
    for name, spec in datasets().items():
        folder = staging / name
        for split, rows in spec["splits"].items():
            write_split(folder / split, spec, rows, spec.get("parts", {}).get(split, 1))
        (folder / "manifest.json").write_text(json.dumps(manifest(name, spec, folder), indent=2))
        columns = spec["columns"]
        entry = {
            "columns": columns,
            "compression": spec["compression"],
            "hashes": spec["hashes"],
            "splits": {
                split: [{c: plain(row[c], e) for c, e in columns.items()} for row in rows]
                for split, rows in spec["splits"].items()
            },
        }
        if "image" in columns:
            entry["pixels"] = {
                split: [pixels(row["image"]) for row in rows]
                for split, rows in spec["splits"].items()
            }
        expected["datasets"][name] = entry
    (staging / "expected.json").write_text(
        json.dumps(expected, indent=1, ensure_ascii=False) + "\n"
    )
    (staging / "README.md").write_text(readme(versions, today))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder to (re)write")
    args = parser.parse_args()
    versions = require_writer()
    today = datetime.date.today().isoformat()
    for name, v in versions.items():
        print(f"{name} {v}")
    write(args.out.resolve(), versions, today)
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.out} ({total} bytes) on {today}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
