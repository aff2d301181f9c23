"""Object detection with torchvision's RetinaNet under DDP, on the generated shapes dataset.

`train` runs on every rank with the strategy the subflow chose and the shared loop; a micro-
batch is `(images, targets)`: a list of image tensors and a list of `{"boxes", "labels"}`
dicts, which the loop moves to the rank's device as they are. The step's global batch is a
function of the seed and the step only, so every rank (and a resumed run, on any world size)
takes exactly its slice of the same images. `evaluate` measures the COCO mAP of the trained
and of the untrained model on the held-out split.
"""

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torchvision.models.detection import RetinaNet

from trainflow import checkpoint, runtime
from trainflow.configs.detection import DetectionConfig, DetectionJob
from trainflow.data.errors import DataError
from trainflow.data.paths import is_remote, join_uri, stream_cache_dir
from trainflow.data.shapes import decode_png
from trainflow.models.detection import BoxPredictor, build_retinanet
from trainflow.strategies.base import Strategy
from trainflow.strategies.job import TrainResult, local_path
from trainflow.strategies.loop import Batch, Schedule, exported, fit
from trainflow.tracking import PROGRESS_FILE, SINK_IMPORTS, metrics_sink
from trainflow.workloads import Evaluation
from trainflow.workloads.detection_checks import check_config as check_config

# Imported by the ranks only once they run (the MDS reader; rank 0's MLflow store); the
# launch's standby agent imports them ahead.
RANK_IMPORTS = ("streaming", *SINK_IMPORTS)

Target = dict[str, Tensor]
Split = list[tuple[Tensor, Target]]


def build_model(job: DetectionJob) -> RetinaNet:
    """The RetinaNet `job.config` describes, freshly initialised."""
    return _build(job.config)


def _build(config: DetectionConfig) -> RetinaNet:
    m = config.model
    return build_retinanet(
        config.data.num_classes,
        config.data.image_size,
        m.backbone,
        m.fpn_channels,
        m.detections_per_image,
    )


def read_split(uri: str, split: str) -> Split:
    """Every image of a prepared split with its targets, decoded (the dataset is small).

    Each rank reads the whole split from the published MDS shards and draws its slice of
    each step's batch itself, so no rank depends on how `streaming` would partition it. Local
    shards are read in place, so their hashes are checked here first (`streaming` checks
    only the copies it fetches into a cache); a dataset in object storage is copied into its
    local stream cache first, each copy checked against its hash (`fetch_split`).

    Raises:
        DataError: naming a damaged or missing shard file of the published dataset.
    """
    from streaming import LocalDataset

    from trainflow.data.loader import verify_published_split

    if is_remote(uri):
        local = fetch_split(uri, split)
    else:
        verify_published_split(uri, split)
        local = uri
    samples = LocalDataset(local=local, split=split)
    out: Split = []
    for i in range(len(samples)):
        row = samples[i]
        image = torch.from_numpy(decode_png(row["image"]).copy()).permute(2, 0, 1)
        target = {
            "boxes": torch.from_numpy(row["boxes"].reshape(-1, 4).copy()),
            "labels": torch.from_numpy(row["labels"].copy()),
        }
        out.append((image.float() / 255, target))
    return out


def fetch_split(uri: str, split: str) -> str:
    """Copy a split of a dataset in object storage into its local stream cache
    (`stream_cache_dir`), every shard checked against the hash in its published index, and
    return the cache folder, which `LocalDataset` reads.

    Copies cached earlier that still match are kept (`verify_cached_split` deletes the others),
    so a machine fetches each file once. Each file is fetched under a temporary name and
    renamed into place, so ranks fetching at once never read a half-written one.

    Raises:
        DataError: no dataset or split at `uri`, or a shard there is compressed or does not
            match its hash.
    """
    from trainflow.data.loader import verify_cached_split
    from trainflow.data.store import read_index, read_manifest

    manifest = read_manifest(uri)
    if manifest is None:
        raise DataError(f"no published dataset at {uri} (its manifest.json is missing)")
    index = read_index(uri, split)
    if split not in manifest["splits"] or index is None:
        raise DataError(
            f"split {split!r} not in dataset {uri}; it has {sorted(manifest['splits'])}"
        )
    cache, hashes = stream_cache_dir(uri), manifest.get("hashes") or []
    verify_cached_split(uri, split, cache, hashes)
    folder = cache / split
    folder.mkdir(parents=True, exist_ok=True)
    for shard in json.loads(index)["shards"]:
        if not shard.get("raw_data"):
            raise DataError(f"{join_uri(uri, split)}: detection reads uncompressed shards only")
        name = shard["raw_data"]["basename"]
        if not (folder / name).is_file():
            _fetch(join_uri(uri, split, name), folder / name)
    _write_aside(folder / "index.json", index)
    damaged = verify_cached_split(uri, split, cache, hashes)
    if damaged:
        names = sorted(Path(p).name for p in damaged)
        raise DataError(
            f"the published dataset {uri} is damaged: shard file(s) {names} of split "
            f"{split!r} do not match their hashes"
        )
    return str(cache)


def _fetch(remote: str, local: Path) -> None:
    """Download `remote` to `local` through a temporary name beside it."""
    from streaming.base.storage import CloudDownloader

    aside = local.with_name(f".{local.name}.{os.getpid()}.tmp")
    try:
        CloudDownloader.direct_download(remote, str(aside))
        os.replace(aside, local)
    finally:
        aside.unlink(missing_ok=True)


def _write_aside(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (through a temporary name beside it)."""
    aside = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    aside.write_bytes(data)
    os.replace(aside, path)


def global_batch(config: DetectionConfig, step: int, num_images: int) -> list[int]:
    """Image indices of the whole batch of `step` (1-based): every image once per epoch, in an
    order that depends only on the seed and the epoch."""
    size = config.training.global_batch_size
    epoch, index = divmod(step - 1, num_images // size)
    order = torch.randperm(
        num_images, generator=torch.Generator().manual_seed(config.training.seed * 7919 + epoch)
    )
    return order[index * size : (index + 1) * size].tolist()


def micro_batches(
    config: DetectionConfig, images: Split, step: int, rank: int, world_size: int
) -> list[Batch]:
    """This rank's contiguous slice of the step's global batch, as one micro-batch."""
    per_rank = config.per_rank_batch_size(world_size)
    mine = global_batch(config, step, len(images))[rank * per_rank : (rank + 1) * per_rank]
    return [([images[i][0] for i in mine], [images[i][1] for i in mine])]


def compute(model: nn.Module, batch: Batch) -> dict[str, Tensor]:
    """RetinaNet's focal classification and box regression losses of one micro-batch."""
    images, targets = batch
    losses = model(images, targets)
    return {"loss": sum(losses.values()), **losses}


def train(
    job: DetectionJob,
    strategy: Strategy,
    *,
    output_dir: str,
    mlflow_run_id: str | None = None,
    resume_from: str | None = None,
) -> TrainResult:
    """Train on this rank with `strategy` (DDP); checkpoint, then export the weights."""
    config = job.config
    t = config.training
    rank, world = runtime.get_global_rank(), runtime.get_world_size()
    images = read_split(job.data.uri, "train")
    torch.manual_seed(t.seed)
    strategy.wrap(
        build_model(job),
        t.optimizer,
        micro_batch_size=config.per_rank_batch_size(world),
        grad_accum_steps=1,
    )
    start = 0
    if (resume := checkpoint.resolve(resume_from)) is not None:
        start, _ = strategy.load(resume)
        runtime.print0(f"resumed from {resume} at step {start}")
    print(
        f"rank {rank}/{world} on {strategy.device}: {len(images)} images, "
        f"{t.num_steps} steps of {config.per_rank_batch_size(world)} images",
        flush=True,
    )
    fitted = fit(
        strategy,
        lambda step: micro_batches(config, images, step, rank, world),
        compute,
        Schedule.of(t.num_steps, t.log_every, config),
        metrics_sink(mlflow_run_id, runtime.is_rank_zero()),
        Path(output_dir) / "checkpoints",
        start_step=start,
        progress_file=Path(output_dir) / PROGRESS_FILE,
    )
    return exported(strategy, fitted, output_dir)


def load_model(job: DetectionJob, model_path: str | Path) -> RetinaNet:
    """Rebuild the model and load exported weights with the safe loader."""
    model = build_model(job)
    model.load_state_dict(torch.load(model_path, map_location="cpu", weights_only=True))
    return model.eval()


@torch.no_grad()
def predict(model: RetinaNet, images: list[Tensor], batch_size: int) -> list[Target]:
    """The model's detections (`boxes`, `scores`, `labels`) for each image."""
    model.eval()
    found: list[Target] = []
    for i in range(0, len(images), batch_size):
        found.extend(model(images[i : i + batch_size]))
    return found


def mean_average_precision(
    model: RetinaNet, held_out: Split, batch_size: int, prefix: str
) -> dict[str, float]:
    """COCO mAP (IoU 0.50:0.95), mAP at IoU 0.50 and 0.75 of `model` on `held_out`."""
    from torchmetrics.detection import MeanAveragePrecision

    metric = MeanAveragePrecision(box_format="xyxy", iou_type="bbox")
    metric.update(
        predict(model, [image for image, _ in held_out], batch_size),
        [target for _, target in held_out],
    )
    result = metric.compute()
    return {f"{prefix}_{k}": float(result[k]) for k in ("map", "map_50", "map_75")}


def evaluate(job: DetectionJob, trained: TrainResult) -> Evaluation:
    """Held-out mAP of the trained and of the untrained model (same seed, no training).

    The trained model is kept for registration, with one held-out image as its input example.
    """
    config = job.config
    held_out = read_split(job.data.uri, "validation")
    model = load_model(job, local_path(trained.model_uri))
    torch.manual_seed(config.training.seed)
    untrained = build_model(job)
    batch = config.evaluation.batch_size
    metrics = mean_average_precision(model, held_out, batch, "eval")
    metrics |= mean_average_precision(untrained, held_out, batch, "untrained")
    example = held_out[0][0][None].numpy()
    return Evaluation(metrics, model, example)


def predictions_figure(job: DetectionJob, model: RetinaNet) -> Any:
    """A grid of held-out images with the boxes `model` predicts (label and score on each)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    from trainflow.data.shapes import PALETTE, SHAPES

    e = job.config.evaluation
    shown = read_split(job.data.uri, "validation")[: e.num_plot_images]
    found = predict(model, [image for image, _ in shown], e.batch_size)
    columns = min(3, len(shown))
    rows = -(-len(shown) // columns)
    fig = Figure(figsize=(3 * columns, 3 * rows), dpi=100)
    axes = list(fig.subplots(rows, columns, squeeze=False).flat)
    for ax in axes:
        ax.set_axis_off()
    for ax, (image, _), d in zip(axes, shown, found, strict=False):  # a last row may have gaps
        ax.imshow(image.permute(1, 2, 0).numpy())
        for box, score, label in zip(d["boxes"], d["scores"], d["labels"], strict=True):
            if score < e.plot_min_score:
                continue
            x1, y1, x2, y2 = box.tolist()
            colour = np.array(PALETTE[int(label)]) / 255
            ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, color=colour, lw=2))
            name = SHAPES[int(label) % len(SHAPES)]
            ax.text(
                x1,
                y1,
                f"{int(label)} {name} {score:.2f}",
                color="white",
                fontsize=7,
                va="bottom",
                bbox={"facecolor": colour, "pad": 1, "lw": 0},
            )
    fig.suptitle(f"held-out predictions (score >= {e.plot_min_score})")
    fig.tight_layout()
    return fig


def log_model(
    job: DetectionJob, evaluation: Evaluation, run_id: str, name: str, tags: dict[str, str]
) -> str:
    """Log the trained detector (images in, boxes out) to the run and add a registry version."""
    from trainflow.tracking import register_pytorch_model

    predictor = BoxPredictor(evaluation.model)
    return register_pytorch_model(run_id, predictor, name, evaluation.input_example, tags)
