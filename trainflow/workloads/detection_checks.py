"""The detection pipeline's checks, kept apart from the training code: they load no torch, so
they run in a second before the server starts, and in `--dry-run`."""

import numpy as np

from trainflow.configs.detection import DetectionConfig
from trainflow.data.shapes import render


def check_config(config: DetectionConfig) -> None:
    """Refuse, before data is generated or any rank starts, what would only fail later.

    The mAP needs a COCO evaluation backend, and every class must appear among the held-out
    images, or its precision would be measured on nothing (the held-out boxes are drawn here:
    a second for the default sizes).

    Raises:
        ValueError: naming the option to change.
    """
    import importlib.util

    if not any(importlib.util.find_spec(m) for m in ("pycocotools", "faster_coco_eval")):
        raise ValueError(
            "evaluation needs pycocotools (or faster-coco-eval) for the COCO mAP; "
            "install the project's dependencies"
        )
    spec, data = config.data.spec(), config.data
    index = sorted(data.counts()).index("validation")
    seen: set[int] = set()
    for i in range(data.num_eval_images):
        seen.update(render(spec, np.random.default_rng([spec.seed, index, i]))[2].tolist())
    missing = sorted(set(range(data.num_classes)) - seen)
    if missing:
        raise ValueError(
            f"data.num_eval_images={data.num_eval_images}: the held-out images show no object "
            f"of class(es) {missing} of data.num_classes={data.num_classes}; use more images"
        )
