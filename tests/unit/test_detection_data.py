"""The shapes generator and the `detection` transform, through real Parquet files and MDS."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trainflow.configs.detection import DetectionConfig, ShapesData
from trainflow.data import DataConfig, DataError, prepare_dataset
from trainflow.data.shapes import ShapesSpec, decode_png, render, shapes_rows, write_shapes
from trainflow.workloads.detection import read_split

SPEC = ShapesSpec(num_classes=4, image_size=48, max_objects=4, min_object_size=10)


def test_generator_is_deterministic_and_boxes_lie_inside_their_images():
    first, again = shapes_rows(SPEC, 0, 40), shapes_rows(SPEC, 0, 40)
    assert first == again
    assert shapes_rows(SPEC, 1, 5) != first[:5]  # splits never share an image
    assert shapes_rows(SPEC, 0, 10) == first[:10]  # a larger split extends a smaller one
    seen = set()
    for row in first:
        pixels = decode_png(row["image"])
        assert pixels.shape == (48, 48, 3)
        boxes = np.array(row["boxes"])
        assert 1 <= len(boxes) == len(row["labels"]) <= 4
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 2:] <= 48).all()
        assert (boxes[:, 2:] > boxes[:, :2]).all()
        seen.update(row["labels"])
    assert seen == {0, 1, 2, 3}


def test_boxes_are_the_tight_bounds_of_the_drawn_shapes():
    pixels, boxes, labels = render(SPEC, np.random.default_rng(7))
    for box in boxes.astype(int):
        x1, y1, x2, y2 = box
        inside = pixels[y1:y2, x1:x2].astype(int)
        # The shape's own saturated colour reaches every edge of its box.
        colourful = inside.max(axis=2) - inside.min(axis=2) > 100
        assert colourful[0].any() and colourful[-1].any()
        assert colourful[:, 0].any() and colourful[:, -1].any()


def _config(files: dict[str, str], tmp_path, num_classes: int = 4) -> DataConfig:
    return DataConfig(
        name="shapes-test",
        source={"kind": "files", "files": {s: [p] for s, p in files.items()}},
        transform={"name": "detection", "num_classes": num_classes},
        compression=None,
        shard_size="1mb",
        output_root=str(tmp_path / "datasets"),
    )


def test_shapes_round_trip_through_mds(tmp_path):
    paths = write_shapes(tmp_path / "src", SPEC, {"train": 24, "validation": 8})
    result = prepare_dataset(_config({s: str(p) for s, p in paths.items()}, tmp_path))
    assert {s: i.num_samples for s, i in result.splits.items()} == {"train": 24, "validation": 8}
    assert result.columns == {
        "id": "int64",
        "image": "bytes",
        "boxes": "ndarray:float32",
        "labels": "ndarray:int64",
    }
    source = shapes_rows(SPEC, 1, 8)  # "validation" sorts second
    read = read_split(result.uri, "validation")
    assert len(read) == 8
    for (image, target), row in zip(read, source, strict=True):
        expected = torch.from_numpy(decode_png(row["image"]).copy()).permute(2, 0, 1) / 255
        assert torch.equal(image, expected.float())
        assert target["boxes"].tolist() == row["boxes"]
        assert target["labels"].tolist() == row["labels"]
    # Regenerating writes nothing new and prepares nothing new.
    assert write_shapes(tmp_path / "src", SPEC, {"train": 24, "validation": 8}) == paths
    again = prepare_dataset(_config({s: str(p) for s, p in paths.items()}, tmp_path))
    assert again.cache_hit and again.uri == result.uri


def _write(path, rows) -> str:
    schema = pa.schema(
        [
            ("image", pa.binary()),
            ("boxes", pa.list_(pa.list_(pa.float32()))),
            ("labels", pa.list_(pa.int64())),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"labels": [9]}, r"column 'labels' has labels \[9\] outside 0..3"),
        ({"boxes": [[40.0, 0.0, 60.0, 10.0]]}, "column 'boxes' has a box that is empty or outside"),
        ({"labels": [0, 1]}, "2 label\\(s\\) in 'labels' for 1 box\\(es\\) in 'boxes'"),
        ({"image": b"not a png"}, "column 'image' is not an image"),
    ],
    ids=["label", "box", "count", "image"],
)
def test_bad_rows_fail_naming_the_row_and_column(tmp_path, change, message):
    rows = shapes_rows(SPEC, 0, 3)
    rows = [{"image": r["image"], "boxes": r["boxes"][:1], "labels": r["labels"][:1]} for r in rows]
    rows[2] = rows[2] | change
    path = _write(tmp_path / "train.parquet", rows)
    with pytest.raises(DataError, match=message) as err:
        prepare_dataset(_config({"train": path}, tmp_path))
    assert "row id 2 of split 'train'" in str(err.value)
    assert not (tmp_path / "datasets").exists() or not any((tmp_path / "datasets").iterdir())


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"data": {"num_classes": 0}}, "data.num_classes"),
        ({"data": {"num_eval_images": 0}}, "data.num_eval_images"),
        ({"data": {"image_size": 16}}, "data.image_size"),
        ({"training": {"global_batch_size": 15}}, "training.global_batch_size=15"),
        ({"data": {"num_train_images": 8}}, "data.num_train_images=8"),
    ],
    ids=["zero-classes", "empty-eval-split", "tiny-images", "batch-split", "no-full-step"],
)
def test_bad_config_names_the_field(update, field):
    with pytest.raises(ValueError) as err:
        DetectionConfig.model_validate(update)
    located = [".".join(str(p) for p in e["loc"]) for e in err.value.errors()]
    assert field in str(err.value) or field in located


def test_spec_scales_objects_with_the_image():
    spec = ShapesData(image_size=128).spec()
    assert (spec.min_object_size, spec.max_object_size) == (28, 56)
