"""A run stopped mid-way and resumed from its checkpoint ends with exactly the weights of the run
that was never stopped: every piece of training state is in the checkpoint.

Each pipeline trains twice on 2 real gloo ranks: once uninterrupted, once with rank 1 SIGKILLed
a few steps after the checkpoint (as `tests/distributed/test_recovery.py` does), so torch
elastic restarts both ranks and they resume from it. Every tensor of the weights the two runs
end with (and of the optimizer, where the pipeline's last checkpoint holds it) must be
`torch.equal`: fp32 on CPU, the same operations in the same order, nothing left to tolerance.
"""

import importlib
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainflow import checkpoint, launch, runtime
from trainflow.configs.detection import DetectionJob, load_detection_preset
from trainflow.configs.mlp import MLPConfig
from trainflow.configs.transformer import TransformerConfig
from trainflow.configs.two_tower import TwoTowerJob, load_two_tower_preset
from trainflow.data import prepare_dataset
from trainflow.strategies.job import Workload, run_on_rank

pytestmark = pytest.mark.slow

KILL_ENV = "EXACT_RESUME_KILL_AFTER_STEP"
CHECKPOINT_AT = 4
KILL_AFTER = CHECKPOINT_AT + 2


def train_and_die(config: Any, strategy: Any, **kwargs: Any) -> Any:
    """The pipeline's own `train`; in the first attempt rank 1 SIGKILLs itself right after the
    heartbeat of the step in `KILL_ENV` (a real kill: no cleanup runs). The result's
    `test_attempt` metric says which attempt finished."""
    kill_after = int(os.environ.get(KILL_ENV, "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if kill_after and attempt == 0 and os.environ.get("RANK") == "1":
        beat = runtime.heartbeat

        def heartbeat(step: int) -> None:
            beat(step)
            if step >= kill_after:
                os.kill(os.getpid(), signal.SIGKILL)

        runtime.heartbeat = heartbeat
    train = importlib.import_module(f"trainflow.workloads.{_pipeline(config)}").train
    result = train(config, strategy, **kwargs)
    result.metrics["test_attempt"] = float(attempt)
    return result


def _run(config: Any, resources: Any, out: Path, kill_after: int = 0) -> Any:
    workload = Workload(
        train_fn=train_and_die,
        model_fn=f"trainflow.workloads.{_pipeline(config)}:build_model",
        config=config,
        output_dir=str(out),
        framework="lightning" if isinstance(config, TwoTowerJob) else "torch",
        resume_from=str(out / "checkpoints"),
    )
    options = resources.resources.launch_options()
    options = type(options)(**{**options.__dict__, "env": {KILL_ENV: str(kill_after)}})
    technique = (
        config.config if isinstance(config, DetectionJob | TwoTowerJob) else config
    ).technique
    return launch(run_on_rank, (workload, technique), options=options).values[0]


def _pipeline(config: Any) -> str:
    return {
        MLPConfig: "mlp",
        TransformerConfig: "transformer",
        DetectionJob: "detection",
        TwoTowerJob: "two_tower",
    }[type(config)]


def _dcp_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimizer), read whole without a group."""
    metadata = FileSystemReader(folder).read_metadata()
    state = {
        fqn: torch.empty(meta.size, dtype=meta.properties.dtype)
        for fqn, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    return state


def _flat_tensors(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if not isinstance(value, dict | list | tuple):
        return {}
    items = value.items() if isinstance(value, dict) else enumerate(value)
    found: dict[str, torch.Tensor] = {}
    for key, item in items:
        found |= _flat_tensors(item, f"{prefix}.{key}" if prefix else str(key))
    return found


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    differ = [name for name, tensor in want.items() if not torch.equal(got[name], tensor)]
    assert differ == [], f"{len(differ)} of {len(want)} tensors differ: {differ[:5]}"


def _final_state(out: Path, pipeline: str) -> dict[str, torch.Tensor]:
    last = checkpoint.latest_checkpoint(out / "checkpoints")
    assert last is not None
    if pipeline == "two_tower":
        saved = torch.load(last / "lightning.ckpt", weights_only=True, map_location="cpu")
        return _flat_tensors({"model": saved["state_dict"], "optim": saved["optimizer_states"]})
    return _dcp_tensors(last)


def _assert_resumed_exactly(config: Any, resources: Any, tmp_path: Path) -> Any:
    pipeline = _pipeline(config)
    reference = _run(config, resources, tmp_path / "uninterrupted")
    resumed = _run(config, resources, tmp_path / "resumed", kill_after=KILL_AFTER)
    assert reference.metrics["test_attempt"] == 0.0
    assert resumed.metrics["test_attempt"] == 1.0  # rank 1 was killed; the restart finished
    assert resumed.steps == reference.steps > KILL_AFTER
    model = "model.pt"
    _assert_equal(
        torch.load(tmp_path / "resumed" / model, weights_only=True),
        torch.load(tmp_path / "uninterrupted" / model, weights_only=True),
    )
    _assert_equal(
        _final_state(tmp_path / "resumed", pipeline),
        _final_state(tmp_path / "uninterrupted", pipeline),
    )
    return resumed


def test_mlp_resumes_exactly(tmp_path):
    config = MLPConfig(
        num_train_samples=512,
        batch_size=32,
        num_epochs=2,  # 8 steps an epoch on 2 ranks: the restart crosses an epoch
        log_every=1,
        checkpoint_every=CHECKPOINT_AT,
        gpu_type="cpu",
        timeout_s=300,
        max_restarts=1,
    )
    _assert_resumed_exactly(config, config, tmp_path)


def test_transformer_resumes_exactly(tmp_path):
    config = TransformerConfig.model_validate(
        {
            "model": {"d_model": 32, "num_heads": 2, "num_layers": 2, "d_ff": 64, "seq_len": 16},
            "training": {"num_steps": 10, "global_batch_size": 8, "log_every": 1},
            "checkpoint_every": CHECKPOINT_AT,
            "gpu_type": "cpu",
            "timeout_s": 300,
            "max_restarts": 1,
        }
    )
    _assert_resumed_exactly(config, config, tmp_path)


def test_detection_resumes_exactly(tmp_path):
    from trainflow.data.shapes import generated_files

    preset = load_detection_preset("debug_cpu")
    config = preset.model_copy(
        update={
            "training": preset.training.model_copy(update={"num_steps": 9, "log_every": 1}),
            "data": preset.data.model_copy(update={"num_train_images": 64}),
            "checkpoint_every": CHECKPOINT_AT,
            "timeout_s": 300,
            "max_restarts": 1,
        }
    )
    files = generated_files(config.data.spec(), config.data.counts())
    job = DetectionJob(config=config, data=prepare_dataset(config.data_config(files)))
    _assert_resumed_exactly(job, config, tmp_path)


def test_two_tower_resumes_exactly(tmp_path):
    """Lightning's checkpoint holds the weights, optimizer, loop and loader position; each
    rank's RNG streams and its sampled negatives' generator are in `rank_<r>.state.pt` beside
    it (Lightning writes its checkpoint from rank 0 only)."""
    from trainflow.workloads.two_tower import item_categories

    preset = load_two_tower_preset("debug_cpu")
    config = preset.model_copy(
        update={
            "training": preset.training.model_copy(update={"num_epochs": 1, "max_steps": 10}),
            "checkpoint_every": CHECKPOINT_AT,
            "timeout_s": 300,
            "max_restarts": 1,
        }
    )
    data = prepare_dataset(config.data_config())
    job = TwoTowerJob(config=config, data=data, item_categories=item_categories(config, data))
    _assert_resumed_exactly(job, config, tmp_path)


def test_sft_counts_the_whole_runs_tokens_after_a_resume(tmp_path):
    """`train_num_tokens` of a run resumed from a checkpoint is the whole run's count, as the
    uninterrupted run's; `train_num_tokens_since_resume` is the part trained after it."""
    from tests.unit.conftest_data import chat_config
    from trainflow.configs.sft import SFTJob, load_sft_preset
    from trainflow.data import prepare_dataset

    saved_at, steps = 2, 4
    (tmp_path / "chat").mkdir()
    data = prepare_dataset(chat_config(tmp_path / "chat", num_rows=64))
    preset = load_sft_preset("debug_cpu")
    config = preset.model_copy(
        update={
            "max_steps": steps,
            "checkpoint_every": saved_at,
            "training": preset.training.model_copy(
                update={"per_device_batch_size": 4, "logging_steps": 1}
            ),
        }
    )

    def run(out: Path, resume_from: Path | None = None) -> Any:
        workload = Workload(
            train_fn="trainflow.workloads.sft:train",
            model_fn="trainflow.workloads.sft:build_model",
            config=SFTJob(config=config, data=data),
            output_dir=str(out),
            framework="hf",
            resume_from=str(resume_from) if resume_from else None,
        )
        options = config.resources.launch_options()
        return launch(run_on_rank, (workload, config.technique), options=options).values[0]

    full = run(tmp_path / "full")
    resumed = run(
        tmp_path / "resumed", tmp_path / "full" / "checkpoints" / f"checkpoint-{saved_at}"
    )
    total = full.metrics["train_num_tokens"]
    before = full.history[saved_at]["num_tokens"]
    assert 0 < before < total
    assert resumed.metrics["train_num_tokens"] == total
    assert resumed.metrics["train_num_tokens_since_resume"] == total - before
    assert full.metrics["train_num_tokens_since_resume"] == total  # never resumed
    assert sorted(resumed.history) == list(range(saved_at + 1, steps + 1))
