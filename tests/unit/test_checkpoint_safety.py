"""A checkpoint is data: a pickle planted in any file a resume reads is refused, naming the
file, and its code never runs.

Each test plants a pickle that creates a marker file when unpickled into a real checkpoint of
one format trainflow reads (DCP's `.metadata` and values, our `rank_<r>.state.pt`, Lightning's
`.ckpt`, the Hugging Face Trainer's files, DeepSpeed's files), then resumes the way the
workloads do (`checkpoint.resolve`, the loader the framework uses). The marker must not exist
afterwards. One test resumes the MLP pipeline on 2 real gloo ranks end to end.
"""

import importlib
import json
import pickle
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainflow import checkpoint, launch
from trainflow.compat import safe_load
from trainflow.compat.safe_load import UnsafeCheckpointError
from trainflow.configs.mlp import MLPConfig
from trainflow.errors import RankError
from trainflow.strategies.job import Workload, run_on_rank
from trainflow.workloads.mlp import build_model, train


class Planted:
    """Unpickled, it creates `marker` (what a real attack would do instead: run anything)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "the planted pickle ran"


def _dcp_checkpoint(folder: Path, state: dict) -> Path:
    """A real DCP checkpoint of `state`, published as trainflow publishes one."""
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    checkpoint.mark_complete(folder, 1)
    return folder


def _model_state() -> dict:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _path(file: Path) -> str:
    return re.escape(str(file))


def _refused(folder: Path, file: Path) -> None:
    with pytest.raises(UnsafeCheckpointError, match=_path(file)):
        checkpoint.resolve(folder)
    with pytest.raises(UnsafeCheckpointError, match=_path(file)):
        checkpoint.resolve(folder.parent)  # the folder of checkpoints a --resume passes


def test_a_clean_dcp_checkpoint_passes_and_its_metadata_has_only_allowed_classes(tmp_path):
    """Fails when torch pickles a class into `.metadata` that the restricted unpickler does
    not build: widen `_DCP_CLASSES` after checking it runs no code."""
    folder = _dcp_checkpoint(tmp_path / "ckpts" / "step_000001", _model_state())
    assert checkpoint.resolve(tmp_path / "ckpts") == folder
    safe_load.install()
    state = _model_state()
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    for module, names in safe_load._DCP_CLASSES.items():
        for name in names:
            getattr(importlib.import_module(module), name)


def test_pickle_in_dcp_metadata_is_refused_by_resume_and_by_dcp_itself(tmp_path, marker):
    folder = _dcp_checkpoint(tmp_path / "ckpts" / "step_000001", _model_state())
    (folder / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    _refused(folder, folder / ".metadata")
    # DCP's own reader (as Lightning and accelerate call it) refuses it too, once installed.
    safe_load.install()
    with pytest.raises(BaseException, match=_path(folder / ".metadata")):  # noqa: PT011
        dcp.load(_model_state(), checkpoint_id=folder, no_dist=True)


def test_pickle_in_a_dcp_value_is_refused_naming_its_file(tmp_path, marker):
    """A non-tensor value (an optimizer's param group) is a pickle inside the data file."""
    folder = _dcp_checkpoint(tmp_path / "step_000001", {"lr": Planted(marker)})
    safe_load.install()
    data = sorted(folder.glob("*.distcp"))
    # DCP reports what a rank raised inside its own CheckpointException (a BaseException).
    with pytest.raises(BaseException, match=re.escape(f"{data[0]}, entry lr: refused")):  # noqa: PT011
        dcp.load({"lr": 0.0}, checkpoint_id=folder, no_dist=True)


def test_pickle_in_a_rank_state_file_is_refused(tmp_path, marker):
    folder = _dcp_checkpoint(tmp_path / "ckpts" / "step_000001", _model_state())
    checkpoint.save_rank_state(folder, 0, {"position": 3})
    assert checkpoint.load_rank_state(folder, 0) == {"position": 3}
    state = torch.load(folder / "rank_0.state.pt", weights_only=True)
    torch.save({**state, "extra": Planted(marker)}, folder / "rank_0.state.pt")
    _refused(folder, folder / "rank_0.state.pt")
    with pytest.raises(UnsafeCheckpointError, match=_path(folder / "rank_0.state.pt")):
        checkpoint.load_rank_state(folder, 0)


def test_pickle_in_a_lightning_checkpoint_is_refused(tmp_path, marker):
    folder = tmp_path / "ckpts" / "step_000001"
    folder.mkdir(parents=True)
    state = {"state_dict": _model_state()["model"], "global_step": 1, "loops": {}}
    torch.save(state, folder / "lightning.ckpt")
    checkpoint.mark_complete(folder, 1)
    assert checkpoint.resolve(folder) == folder
    torch.save({**state, "callbacks": Planted(marker)}, folder / "lightning.ckpt")
    _refused(folder, folder / "lightning.ckpt")
    # What `trainer.fit(ckpt_path=..., weights_only=True)` does with the file.
    with pytest.raises(pickle.UnpicklingError):
        torch.load(folder / "lightning.ckpt", weights_only=True)


@pytest.mark.parametrize(
    "file", ["rng_state_0.pth", "optimizer.pt", "scheduler.pt", "trainer_state.json"]
)
def test_pickle_in_a_hugging_face_trainer_checkpoint_is_refused(tmp_path, marker, file):
    folder = tmp_path / "ckpts" / "checkpoint-1"
    folder.mkdir(parents=True)
    # The files the Trainer writes (its RNG state holds NumPy's, which it allowlists).
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.get_rng_state(),
    }
    torch.save(rng, folder / "rng_state_0.pth")
    torch.save(_model_state()["optimizer"], folder / "optimizer.pt")
    torch.save({"last_epoch": 1, "_step_count": 2}, folder / "scheduler.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    torch.save(object(), folder / "training_args.bin")  # pickled arguments, never read back
    checkpoint.mark_complete(folder, 1)
    assert checkpoint.resolve(folder) == folder
    if file.endswith(".json"):
        (folder / file).write_bytes(pickle.dumps(Planted(marker)))
    else:
        torch.save(Planted(marker), folder / file)
    _refused(folder, folder / file)


def test_pickle_in_a_deepspeed_checkpoint_is_refused_by_resume_and_by_deepspeed(tmp_path, marker):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    folder = tmp_path / "ckpts" / "step_000001"
    folder.mkdir(parents=True)
    optim = folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    states = {"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients}
    torch.save({"optimizer_state_dict": states, "ds_version": "0.19"}, optim)
    checkpoint.mark_complete(folder, 1)
    safe_load.install_deepspeed()
    engine = TorchCheckpointEngine()
    assert engine.load(str(optim))["optimizer_state_dict"]["zero_stage"] == 2
    assert checkpoint.resolve(folder) == folder

    model_states = folder / "mp_rank_00_model_states.pt"
    torch.save({"module": _model_state()["model"], "client": Planted(marker)}, model_states)
    _refused(folder, model_states)
    with pytest.raises(UnsafeCheckpointError, match=_path(model_states)):
        engine.load(str(model_states))


def test_the_mlp_pipeline_refuses_to_resume_from_a_planted_checkpoint(tmp_path, marker):
    """2 gloo ranks resume the MLP workload from a checkpoint whose `.metadata` was replaced:
    every rank refuses it before loading anything, naming the file."""
    config = MLPConfig(
        num_train_samples=256, batch_size=32, num_epochs=1, checkpoint_every=2, gpu_type="cpu"
    )
    out = tmp_path / "run"

    def run() -> list:
        workload = Workload(
            train_fn=train,
            model_fn=build_model,
            config=config,
            output_dir=str(out),
            resume_from=str(out / "checkpoints"),
        )
        options = config.resources.launch_options()
        return launch(run_on_rank, (workload, config.technique), options=options).values

    assert run()[0].steps == 4
    latest = checkpoint.latest_checkpoint(out / "checkpoints")
    assert latest is not None
    (latest / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(RankError, match=_path(latest / ".metadata")):
        run()
