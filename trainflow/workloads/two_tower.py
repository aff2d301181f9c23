"""Two-tower recommender trained by the Lightning Trainer on the launcher's ranks.

`train` runs on every rank: Lightning takes the technique from our strategy registry
(`Strategy.lightning_strategy`, which reads the torchelastic environment and the open process
group, so Lightning starts no process of its own), each rank streams its own partition of the
prepared MDS splits, rank 0 logs into the pipeline's MLflow run, and the best checkpoint by
validation AUROC is kept. `evaluate` scores the test split in the orchestrating process, for
the trained towers and the untrained ones; `log_model` registers an MLflow pyfunc that scores
(user, item) pairs and ranks a user's top items.
"""

import json
import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.profilers import Profiler
from torchmetrics.classification import BinaryAUROC
from torchmetrics.functional.classification import binary_auroc

from trainflow import checkpoint, runtime, storage
from trainflow.compat.lightning import leave_sigterm_to_launcher
from trainflow.configs.two_tower import TwoTowerConfig, TwoTowerJob
from trainflow.data import LoaderConfig, PreparedDataset, build_dataloader, read_whole_split
from trainflow.efficiency import EfficiencyMeter
from trainflow.errors import Preempted
from trainflow.models.two_tower import TwoTower, recall_at_k, sampled_negative_loss
from trainflow.strategies.base import Strategy, adamw, gather_full_state_dict
from trainflow.strategies.job import TrainResult, local_path
from trainflow.tracking import PROGRESS_FILE, SINK_IMPORTS, ProgressFile, tracking_uri
from trainflow.workloads import Evaluation
from trainflow.workloads.two_tower_checks import check_config as check_config

# Imported by rank 0 only once Lightning's MLflow logger starts; the launch's standby agent
# imports it ahead.
RANK_IMPORTS = SINK_IMPORTS

LIGHTNING_CHECKPOINT = "lightning.ckpt"


def build_model(job: TwoTowerJob | TwoTowerConfig) -> TwoTower:
    """The towers `job`'s config describes, freshly initialised."""
    t = (job.config if isinstance(job, TwoTowerJob) else job).towers
    return TwoTower(
        t.num_users, t.num_items, t.num_categories, t.embedding_dim, t.hidden_sizes, t.output_dim
    )


def read_split(uri: str, split: str) -> dict[str, np.ndarray]:
    """A prepared split, whole, as one array per column, in id order.

    For the orchestrating process (one reader, no process group); training ranks stream their
    own partitions instead.
    """
    samples = read_whole_split(uri, split, batch_size=1024)
    samples.sort(key=lambda s: int(s["id"]))
    return {key: np.asarray([s[key] for s in samples]) for key in samples[0]}


def item_categories(config: TwoTowerConfig, data: PreparedDataset) -> list[int]:
    """The category of every item id, from all splits (categories describe items, not clicks);
    an item the data never shows gets category 0.

    Read once in the orchestrating process: the ranks, the evaluation and the registered model
    all need the whole table, and a rank sees only its own partition.
    """
    d, table = config.data, [0] * config.towers.num_items
    for split in data.splits:
        rows = read_split(data.uri, split)
        for item, category in zip(rows[d.item_column], rows[d.category_column], strict=True):
            table[int(item)] = int(category)
    return table


class TwoTowerModule(L.LightningModule):
    """The towers, their sampled-negative loss and validation AUROC, as Lightning runs them."""

    # A buffer (`register_buffer` in `__init__`): typed here, as `Module.__getattr__` is not.
    item_categories: torch.Tensor

    def __init__(self, job: TwoTowerJob, strategy: Strategy) -> None:
        super().__init__()
        self.job, self.technique = job, strategy
        self.towers = build_model(job)
        self.register_buffer("item_categories", torch.tensor(job.item_categories), persistent=False)
        self.val_auroc = BinaryAUROC()
        self.negatives = torch.Generator().manual_seed(
            job.config.training.seed + runtime.get_global_rank()
        )
        self.seen: dict[str, Any] = {}
        self.sample_log: list[dict[str, Any]] = []

    def configure_model(self) -> None:
        self.technique.prepare_lightning_model(self.towers)

    def _columns(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        d = self.job.config.data
        return batch[d.user_column], batch[d.item_column], batch[d.label_column].float()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # What Lightning became on this rank, seen from inside it (not the config echoed back).
        self.seen = {
            "world_size": self.trainer.world_size,
            "process_group_size": dist.get_world_size() if dist.is_initialized() else 1,
            "wrapped_as": type(self.trainer.strategy.model).__name__,
        }
        if self.job.config.training.log_samples:
            self.sample_log.append(
                {
                    "epoch": self.current_epoch,
                    "step": self.global_step,
                    "world_size": self.trainer.world_size,
                    "ids": batch["id"].tolist(),
                }
            )
        users, items, labels = self._columns(batch)
        loss = sampled_negative_loss(
            self.towers,
            users,
            items,
            labels,
            self.item_categories,
            self.job.config.training.num_negatives,
            self.negatives,
        )
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        users, items, labels = self._columns(batch)
        logits = self.towers(users, items, self.item_categories[items])
        self.val_auroc.update(torch.sigmoid(logits), labels.long())
        self.log("val_auroc", self.val_auroc, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return adamw(self.parameters(), self.job.config.training.optimizer)


class _RunLogger(MLFlowLogger):
    """Lightning's MLflow logger writing into the pipeline's run, which the pipeline ends."""

    def finalize(self, status: str = "success") -> None:
        """Leave the run open: evaluation and registration still log to it."""


class Durability(Callback):
    """Checkpoints a resume can trust, a stop that leaves one behind, heartbeats and progress.

    - Every `checkpoint_every` steps and at the end, every rank joins `trainer.save_checkpoint`
      into `.step_N.partial/`; once all have, rank 0 marks it complete and renames it
      (`trainflow.checkpoint`), keeping the newest `keep`. Lightning's checkpoint holds the
      weights, optimizer, loop position and the `streaming` loader's position; it is written
      by rank 0 alone, so each rank adds its own RNG streams and its sampled negatives'
      generator (`rank_<r>.state.pt`), which a resume puts back before its first step.
    - After every step the ranks agree whether a stop was requested (SIGTERM: a preemption,
      Ctrl-C or a cancel upstream); if so they checkpoint that step and stop.
    """

    def __init__(
        self,
        config: TwoTowerConfig,
        root: Path,
        output_dir: Path,
        max_steps: int,
        resume: Path | None = None,
    ):
        self.config, self.root = config, root
        self.resume = resume  # this rank's state still to restore, from this checkpoint
        self.stopped_at: int | None = None
        self.last_saved: int | None = None
        self.history: dict[int, dict[str, float]] = {}
        path = output_dir / PROGRESS_FILE if runtime.is_rank_zero() else None
        self.progress = ProgressFile(path, max_steps)

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, *args: Any) -> None:
        # Here rather than when Lightning restores its checkpoint: what runs between the two
        # (opening the loader) must not move the streams the uninterrupted run had here.
        if self.resume is None:
            return
        extra = checkpoint.load_rank_state(self.resume, trainer.global_rank)
        self.resume = None
        if extra is not None:  # None: a rank the checkpoint's world did not have
            module.negatives.set_state(extra["negatives"])

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, *args: Any) -> None:
        step = trainer.global_step
        runtime.heartbeat(step)
        if step % self.config.training.log_every == 0:
            loss = float(trainer.callback_metrics["train_loss"])
            self.history[step] = {"loss": loss}
            self.progress.update(step)
        stop = runtime.should_stop()
        every = self.config.checkpoint_every
        if stop or (every and step % every == 0):
            self.save(trainer, module, step)
        if stop:
            self.stopped_at = step
            trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
        self.progress.update(trainer.global_step)
        if self.config.checkpoint_every and self.stopped_at is None:
            self.save(trainer, module, trainer.global_step)

    def save(self, trainer: L.Trainer, module: TwoTowerModule, step: int) -> None:
        if self.last_saved == step:
            return
        path = checkpoint.checkpoint_path(self.root, step)
        partial = checkpoint.partial_path(path)
        if trainer.is_global_zero:
            partial.mkdir(parents=True, exist_ok=True)
        trainer.strategy.barrier()
        trainer.save_checkpoint(partial / LIGHTNING_CHECKPOINT)
        negatives = module.negatives.get_state()
        checkpoint.save_rank_state(partial, trainer.global_rank, {"negatives": negatives})
        trainer.strategy.barrier()
        if trainer.is_global_zero:
            checkpoint.publish(
                partial,
                path,
                step,
                keep=self.config.keep_checkpoints,
                technique=self.config.technique.name,
                world_size=trainer.world_size,
            )
            storage.mirror_checkpoint(path)
        trainer.strategy.barrier()
        self.last_saved = step


class DataWaitProfiler(Profiler):
    """Adds the time Lightning's training loop spends fetching each batch to `meter`.

    Lightning times every fetch of the train loader as a profiler action
    (`[_TrainingEpochLoop].train_dataloader_next`); this profiler keeps only that one.
    """

    ACTION = "train_dataloader_next"

    def __init__(self, meter: EfficiencyMeter) -> None:
        super().__init__()
        self.meter = meter
        self._started: float | None = None

    def start(self, action_name: str) -> None:
        if action_name.endswith(self.ACTION):
            self._started = time.perf_counter()

    def stop(self, action_name: str) -> None:
        if action_name.endswith(self.ACTION) and self._started is not None:
            self.meter.add_wait(time.perf_counter() - self._started)
            self._started = None


class Efficiency(Callback):
    """Times every training step in `meter` (validation passes left out) and counts its rows;
    at the end gathers the ranks' `eff_*` figures (`trainflow.efficiency`) and logs them
    into the run from rank 0. Data waits come from `DataWaitProfiler`.
    """

    def __init__(self, meter: EfficiencyMeter, label_column: str) -> None:
        self.meter, self.label_column = meter, label_column
        self.figures: dict[str, float] = {}

    def on_train_start(self, trainer: L.Trainer, module: Any) -> None:
        self.meter.start()

    def on_train_batch_end(
        self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, *args: Any
    ) -> None:
        self.meter.count(int(batch[self.label_column].shape[0]))
        self.meter.step()

    def on_validation_start(self, trainer: L.Trainer, module: Any) -> None:
        self.meter.pause()

    def on_validation_end(self, trainer: L.Trainer, module: Any) -> None:
        self.meter.resume()

    def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
        self.figures = self.meter.report()  # every rank: it gathers the ranks' figures
        if trainer.logger and self.figures:
            trainer.logger.log_metrics(self.figures, step=trainer.global_step)


def sample_log_path(output_dir: str | Path, rank: int) -> Path:
    """Where rank `rank` records the row ids it trained on (with `training.log_samples`)."""
    return Path(output_dir) / "samples" / f"rank_{rank}.jsonl"


def trained_model_path(output_dir: str | Path) -> Path:
    """Where `train` exports the best weights (a plain `TwoTower` state dict)."""
    return Path(output_dir) / "model.pt"


def _loaders(job: TwoTowerJob) -> tuple[Any, Any]:
    t = job.config.training
    train = LoaderConfig(batch_size=t.batch_size, shuffle=True, seed=t.seed, drop_last=True)
    held_out = LoaderConfig(batch_size=t.batch_size, shuffle=False, seed=t.seed)
    return (
        build_dataloader(job.data.uri, "train", train),
        build_dataloader(job.data.uri, "validation", held_out),
    )


def train(
    job: TwoTowerJob,
    strategy: Strategy,
    *,
    output_dir: str,
    mlflow_run_id: str | None = None,
    resume_from: str | None = None,
) -> TrainResult:
    """Fit the towers on this rank with the Lightning Trainer; export the best weights.

    Continues from the latest complete checkpoint under `resume_from` when there is one
    (weights, optimizer, loop and loader position). The best weights by validation AUROC are
    loaded back after fitting and exported as `model.pt` (rank 0 writes).

    Raises:
        Preempted: a stop was requested; a checkpoint of the step reached was written.
    """
    config, t = job.config, job.config.training
    out = Path(output_dir)
    L.seed_everything(t.seed, verbose=False)
    train_loader, val_loader = _loaders(job)
    steps_per_epoch = len(train_loader)
    max_steps = min(t.num_epochs * steps_per_epoch, t.max_steps or math.inf)
    resume = checkpoint.resolve(resume_from)
    durable = Durability(config, out / "checkpoints", out, int(max_steps), resume)
    # Two embedding lookups and small MLPs per row: no model-FLOPs estimate, so no MFU.
    meter = EfficiencyMeter(strategy.device)
    efficiency = Efficiency(meter, config.data.label_column)
    best = ModelCheckpoint(
        dirpath=out / "best", filename="best", monitor="val_auroc", mode="max", save_top_k=1
    )
    logger = (
        _RunLogger(tracking_uri=tracking_uri(), run_id=mlflow_run_id) if mlflow_run_id else False
    )
    world, local = runtime.get_world_size(), runtime.get_local_world_size()
    trainer = L.Trainer(
        accelerator="gpu" if strategy.device.type == "cuda" else "cpu",
        devices=local,
        num_nodes=world // local,
        strategy=strategy.lightning_strategy(
            micro_batch_size=t.batch_size, grad_accum_steps=1, optimizer=t.optimizer
        ),
        max_epochs=t.num_epochs,
        max_steps=t.max_steps or -1,
        logger=logger,
        callbacks=[durable, efficiency, best],
        profiler=DataWaitProfiler(meter),
        log_every_n_steps=t.log_every,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    # Lightning has no option to leave SIGTERM alone: its (private) connector is swapped.
    leave_sigterm_to_launcher(trainer)
    module = TwoTowerModule(job, strategy)
    if resume is not None:
        runtime.print0(f"resuming from {resume} at step {checkpoint.read_meta(resume)['step']}")
    ckpt = str(resume / LIGHTNING_CHECKPOINT) if resume is not None else None
    # Checkpoints are data: Lightning's loads refuse pickled code (the folder is checked
    # whole by `checkpoint.resolve` first, naming any such file).
    trainer.fit(module, train_loader, val_loader, ckpt_path=ckpt, weights_only=True)
    if durable.stopped_at is not None:
        saved = f"checkpoint {checkpoint.latest_checkpoint(out / 'checkpoints')}"
        runtime.print0(f"stop requested: stopped after step {durable.stopped_at}; {saved}")
        raise Preempted(
            f"rank {runtime.get_global_rank()} stopped on request after step "
            f"{durable.stopped_at} ({saved})"
        )
    seen = dict(module.seen)
    metrics = {"train_loss": float(trainer.callback_metrics["train_loss"])}
    if t.log_samples:
        path = sample_log_path(out, runtime.get_global_rank())
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.writelines(json.dumps(line) + "\n" for line in module.sample_log)
    # The best weights by validation AUROC, back in the module on every rank (sharded as the
    # technique keeps them), then gathered whole for export.
    validated = trainer.validate(
        module,
        val_loader,
        ckpt_path="best" if best.best_model_path else None,
        verbose=False,
        weights_only=True,
    )
    state = gather_full_state_dict(module.towers)
    if trainer.is_global_zero:
        torch.save(state, trained_model_path(out))
    trainer.strategy.barrier()
    runtime.print0(f"trained as {seen['wrapped_as']} on {seen['world_size']} rank(s)")
    metrics["train_best_val_auroc"] = float(validated[0]["val_auroc"])
    metrics |= efficiency.figures
    return TrainResult(
        technique=strategy.name,
        world_size=seen["world_size"],
        wrapped_as=seen["wrapped_as"],
        steps=trainer.global_step,
        metrics=metrics,
        history=durable.history,
        checkpoint_uri=checkpoint.uri(checkpoint.latest_checkpoint(out / "checkpoints")),
        model_uri=trained_model_path(out).resolve().as_uri(),
    )


def load_model(job: TwoTowerJob, model_path: str | Path | None) -> TwoTower:
    """The towers with the trained weights at `model_path` (safe loader), or with their initial
    weights (the same seed as training's start) when it is None."""
    torch.manual_seed(job.config.training.seed)
    model = build_model(job)
    if model_path is not None:
        model.load_state_dict(torch.load(model_path, map_location="cpu", weights_only=True))
    return model.eval()


@torch.no_grad()
def test_metrics(
    job: TwoTowerJob, model: TwoTower, rows: dict[str, np.ndarray]
) -> dict[str, float]:
    """AUROC of the test pairs' clicks, and recall@k of each user's clicked test items among
    the k best-scored of all items."""
    d, k = job.config.data, job.config.evaluation.top_k
    categories = torch.tensor(job.item_categories)
    users = torch.as_tensor(rows[d.user_column]).long()
    items = torch.as_tensor(rows[d.item_column]).long()
    labels = torch.as_tensor(rows[d.label_column]).long()
    auroc = binary_auroc(torch.sigmoid(model(users, items, categories[items])), labels)
    test_users = sorted(set(users.tolist()))
    clicked: dict[int, set[int]] = {u: set() for u in test_users}
    for user, item, label in zip(users.tolist(), items.tolist(), labels.tolist(), strict=True):
        if label:
            clicked[user].add(item)
    scores = model.score_all(torch.tensor(test_users), categories)
    recall = recall_at_k(scores, [clicked[u] for u in test_users], k)
    return {"auroc": float(auroc), f"recall_at_{k}": recall}


def evaluate(job: TwoTowerJob, trained: TrainResult) -> Evaluation:
    """Test-split metrics of the trained towers (`eval_*`) and the untrained ones
    (`untrained_*`); the trained model is kept for registration with test pairs as its input
    example."""
    import pandas as pd

    d = job.config.data
    rows = read_split(job.data.uri, "test")
    model = load_model(job, local_path(trained.model_uri))
    metrics: dict[str, float] = {}
    for prefix, candidate in (("untrained", load_model(job, None)), ("eval", model)):
        metrics |= {f"{prefix}_{k}": v for k, v in test_metrics(job, candidate, rows).items()}
    metrics["eval_auroc_gain"] = metrics["eval_auroc"] - metrics["untrained_auroc"]
    example = pd.DataFrame(
        {"user_id": rows[d.user_column][:5].astype("int64"), "item_id": rows[d.item_column][:5]}
    ).astype("int64")
    return Evaluation(metrics, model, input_example=example)


def log_model(
    job: TwoTowerJob, evaluation: Evaluation, run_id: str, name: str, tags: dict[str, str]
) -> str:
    """Log the recommender as an MLflow pyfunc (scores pairs, ranks a user's top items) with
    its signature and input example, register it and tag the version."""
    from trainflow.models.two_tower_pyfunc import register_recommender

    return register_recommender(
        run_id,
        evaluation.model,
        job.config.towers.model_dump(),
        job.item_categories,
        name,
        evaluation.input_example,
        tags,
    )
