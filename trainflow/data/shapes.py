"""A small object-detection dataset drawn deterministically: coloured shapes on textured ground.

Each class is a shape (square, disc, triangle, diamond) in its own colour, so a small detector
trained from scratch for a few minutes on a CPU finds and names them, while an untrained one
does not. Backgrounds are random stripes with noise, so "anything coloured" is not enough.

Images are written as PNG bytes with their boxes (`x1, y1, x2, y2` in pixels, the tight bounds
of the drawn shape) and labels (`0..num_classes-1`) to one Parquet file per split, which the
`files` source reads and the `detection` transform writes to MDS.

    paths = write_shapes(Path("out"), ShapesSpec(num_classes=3), {"train": 256, "validation": 64})
"""

import hashlib
import io
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

SHAPES = ("square", "disc", "triangle", "diamond")
# Distinct, saturated colours; backgrounds stay greyish, so colour is a cue but not the only one.
PALETTE = (
    (230, 40, 40),
    (40, 170, 40),
    (40, 80, 230),
    (240, 200, 20),
    (200, 40, 200),
    (20, 200, 210),
    (250, 130, 10),
    (120, 60, 20),
)
MAX_CLASSES = len(PALETTE)
# Placement attempts before an object that keeps overlapping the others is left out.
_PLACEMENT_TRIES = 20
_MAX_OVERLAP_IOU = 0.2


@dataclass(frozen=True)
class ShapesSpec:
    """What the generated images look like (the same spec and seed give the same bytes)."""

    num_classes: int = 3
    image_size: int = 64
    max_objects: int = 3
    min_object_size: int = 14
    max_object_size: int = 28
    seed: int = 0

    def fingerprint(self, counts: dict[str, int]) -> str:
        """Short hash of the spec and split sizes: the generated files' folder name."""
        payload = json.dumps({"spec": asdict(self), "counts": counts}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """Grey-ish stripes at a random angle and period, plus pixel noise (H x W x 3, float)."""
    low, high = rng.uniform(60, 120, 3), rng.uniform(130, 200, 3)
    angle, period = rng.uniform(0, np.pi), rng.uniform(4, 16)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    wave = 0.5 + 0.5 * np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / period)
    image = low + (high - low) * wave[..., None]
    return image + rng.normal(0, 12, (size, size, 3))


def _mask(kind: str, size: int, x0: int, y0: int, side: int) -> np.ndarray:
    """Boolean mask of one shape whose bounding square is (x0, y0, side)."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    u, v = (xx + 0.5 - x0) / side, (yy + 0.5 - y0) / side  # 0..1 inside the square
    inside = (u >= 0) & (u <= 1) & (v >= 0) & (v <= 1)
    if kind == "square":
        return inside
    if kind == "disc":
        return (u - 0.5) ** 2 + (v - 0.5) ** 2 <= 0.25
    if kind == "triangle":  # apex up, base along the bottom
        return inside & (np.abs(u - 0.5) <= v / 2)
    return np.abs(u - 0.5) + np.abs(v - 0.5) <= 0.5  # diamond


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    x1, y1 = max(a[0], b[0]), max(a[1], b[1])
    x2, y2 = min(a[2], b[2]), min(a[3], b[3])
    inter = max(0.0, x2 - x1) * max(0.0, y2 - y1)
    area = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / area)


def render(spec: ShapesSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One image (H x W x 3 uint8), its boxes (N x 4 float32, xyxy pixels) and labels (N int64).

    Every image has at least one object; boxes are the tight bounds of the drawn pixels, so
    they lie inside the image and are never empty.
    """
    size = spec.image_size
    image = _background(rng, size)
    boxes: list[np.ndarray] = []
    labels: list[int] = []
    for _ in range(int(rng.integers(1, spec.max_objects + 1))):
        label = int(rng.integers(spec.num_classes))
        for _ in range(_PLACEMENT_TRIES):
            side = int(rng.integers(spec.min_object_size, spec.max_object_size + 1))
            x0, y0 = (int(v) for v in rng.integers(0, size - side + 1, 2))
            mask = _mask(SHAPES[label % len(SHAPES)], size, x0, y0, side)
            ys, xs = np.nonzero(mask)
            box = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=np.float32)
            if all(_iou(box, other) <= _MAX_OVERLAP_IOU for other in boxes):
                break
        else:
            continue
        shade = rng.uniform(0.85, 1.0)
        image[mask] = np.array(PALETTE[label]) * shade + rng.normal(0, 6, (int(mask.sum()), 3))
        boxes.append(box)
        labels.append(label)
    pixels = np.clip(image, 0, 255).astype(np.uint8)
    return pixels, np.stack(boxes), np.array(labels, dtype=np.int64)


def encode_png(pixels: np.ndarray) -> bytes:
    """PNG bytes of an H x W x 3 uint8 image."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(out, format="PNG")
    return out.getvalue()


def decode_png(data: bytes) -> np.ndarray:
    """H x W x 3 uint8 pixels of PNG (or any image) bytes."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def shapes_rows(spec: ShapesSpec, split_index: int, num_images: int) -> list[dict[str, Any]]:
    """Rows `{image: PNG bytes, boxes: [[x1, y1, x2, y2], ...], labels: [...]}` of one split.

    Image `i` of split `split_index` depends only on the spec, the split and `i`, so a larger
    split starts with the images of a smaller one and splits never share an image.
    """
    rows = []
    for i in range(num_images):
        pixels, boxes, labels = render(spec, np.random.default_rng([spec.seed, split_index, i]))
        rows.append(
            {"image": encode_png(pixels), "boxes": boxes.tolist(), "labels": labels.tolist()}
        )
    return rows


def write_shapes(out: Path, spec: ShapesSpec, counts: dict[str, int]) -> dict[str, Path]:
    """Write one Parquet file per split (`counts`: split -> images) under `out`.

    A file already there is kept: the same spec and counts always give the same rows. Each
    file is written beside its final name and renamed, so a reader never sees half of one.

    Returns:
        Split name -> Parquet file.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for index, (split, count) in enumerate(sorted(counts.items())):
        path = out / f"{split}.parquet"
        paths[split] = path
        if path.is_file():
            continue
        table = pa.Table.from_pylist(
            shapes_rows(spec, index, count),
            schema=pa.schema(
                [
                    ("image", pa.binary()),
                    ("boxes", pa.list_(pa.list_(pa.float32()))),
                    ("labels", pa.list_(pa.int64())),
                ]
            ),
        )
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        pq.write_table(table, partial)
        partial.replace(path)
    return paths


def generated_files(spec: ShapesSpec, counts: dict[str, int]) -> dict[str, str]:
    """Generate (once) the splits of `spec` under `$TRAINFLOW_HOME/sources`; split -> file.

    The folder is named by the spec's fingerprint, so runs with the same spec share it and
    the dataset prepared from it is found in the cache.
    """
    from trainflow.paths import trainflow_home

    out = trainflow_home() / "sources" / f"shapes-{spec.fingerprint(counts)}"
    return {split: str(path) for split, path in write_shapes(out, spec, counts).items()}
