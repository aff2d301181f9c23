"""Unsloth on CUDA GPUs: the tiny config through torchrun, as our ranks run it.

Real GPUs only (no mocks), from .venvs/unsloth (`bash scripts/setup-framework.sh unsloth`):
skipped, saying which is missing, elsewhere. The first test uses 1 GPU, the second 2 (DDP).
"""

import math
import os
from pathlib import Path

import pytest
import torch

from tests.frameworks.unsloth_torchrun import VENV_BIN, run_tiny_config
from trainflow.frameworks import unsloth as u

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        not (VENV_BIN / "torchrun").exists(),
        reason="needs .venvs/unsloth: bash scripts/setup-framework.sh unsloth",
    ),
]


def run_tiny(tmp_path: Path, gpus: int) -> tuple[list[dict], str]:
    """Train unsloth-tiny.yaml on `gpus` GPUs with torchrun; each rank's result and the log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNSLOTH_")}
    env["HF_HUB_OFFLINE"] = "1"
    env["UNSLOTH_DISABLE_STATISTICS"] = "1"
    done, results, _ = run_tiny_config(tmp_path, gpus, max_steps=6, env=env, timeout=540)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    return results, log


def assert_trained(results: list[dict], log: str, tmp_path: Path) -> None:
    assert "training on CPU" not in log  # Unsloth's GPU path, not its CPU backend
    for rank, result in enumerate(results):
        assert result["rank"] == rank and result["world_size"] == len(results)
        assert result["device"] == "cuda" and result["steps"] == 6
        assert result["train_loss"] is not None and math.isfinite(result["train_loss"])
        assert all(math.isfinite(loss) for _, loss in result["loss_history"])
    folder = Path(results[0]["output_dir"])
    assert folder == tmp_path / "out" / "merged_16bit"

    # The merged 16-bit folder loads in our main environment (transformers 5.22).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, device_map="cuda").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # transformers 5 returns the encoding (ids and mask) unless asked for the ids alone.
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "add 4 2"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=False,
    ).to("cuda")
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_tiny_config_trains_on_one_gpu_with_torchrun(tmp_path):
    assert u.check_can_train(u.TINY_CONFIG) is None
    assert u.check_can_train(u.LLAMA_3B_CONFIG) is None
    results, log = run_tiny(tmp_path, gpus=1)
    assert_trained(results, log, tmp_path)


def test_tiny_config_trains_with_ddp_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, this machine has {torch.cuda.device_count()}")
    results, log = run_tiny(tmp_path, gpus=2)
    assert_trained(results, log, tmp_path)
    assert results[0]["train_loss"] == results[1]["train_loss"]  # averaged over the ranks
