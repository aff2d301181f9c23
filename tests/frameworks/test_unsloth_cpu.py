"""Unsloth without a GPU: what `import unsloth` and training do, and how we tell in advance.

Unsloth 2026.10 has a CPU backend: without a CUDA device `import unsloth` selects it (stock
transformers + PEFT + TRL, none of Unsloth's Triton kernels) instead of failing, unless
UNSLOTH_DISABLE_CPU_FALLBACK=1. The first tests run in our main environment (no unsloth there);
the others run Unsloth in .venvs/unsloth and skip, saying so, where it is absent.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.frameworks.unsloth_torchrun import run_tiny_config
from trainflow.frameworks import unsloth as u

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO_ROOT / ".venvs" / "unsloth" / "bin" / "python"
NO_FALLBACK = "NotImplementedError: Unsloth cannot find any torch accelerator? You need a GPU."
CPU_BANNER = "no GPU found, training on CPU"

no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="asserts what happens without a CUDA device"
)
needs_venv = pytest.mark.skipif(
    not VENV_PYTHON.exists(),
    reason="needs .venvs/unsloth: bash scripts/setup-framework.sh unsloth",
)


@pytest.fixture
def unsloth_env(monkeypatch):
    """No Unsloth switches from the caller's environment."""
    for name in ("UNSLOTH_DISABLE_CPU_FALLBACK", "UNSLOTH_FORCE_CPU", "UNSLOTH_ALLOW_CPU"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _driver_loaded() -> bool:
    return os.path.exists("/proc/driver/nvidia/version")


# ------------------------------------------------------------------ main environment


@no_cuda
def test_without_a_gpu_unsloth_can_train_on_its_cpu_backend(unsloth_env):
    if _driver_loaded():
        pytest.skip("an NVIDIA driver is loaded here: Unsloth would refuse the CPU fallback")
    assert u.check_can_train() is None
    assert u.check_can_train(u.TINY_CONFIG) is None
    assert u.backend() == "cpu"


@no_cuda
def test_disabling_the_cpu_fallback_is_named(unsloth_env):
    unsloth_env.setenv("UNSLOTH_DISABLE_CPU_FALLBACK", "1")
    reason = u.check_can_train(u.TINY_CONFIG)
    assert reason is not None and reason.startswith("Unsloth needs a CUDA GPU: torch ")
    assert "UNSLOTH_DISABLE_CPU_FALLBACK=1" in reason
    assert "Unsloth cannot find any torch accelerator? You need a GPU." in reason


@no_cuda
def test_the_3b_recipe_refuses_cpu_ranks_before_importing_anything(unsloth_env):
    reason = u.check_can_train(u.LLAMA_3B_CONFIG)
    assert reason is not None and reason.startswith(
        "Unsloth needs a CUDA GPU: this config sets require_gpu: true"
    )
    before = set(sys.modules)
    with pytest.raises(RuntimeError, match=r"^Unsloth needs a CUDA GPU: this config sets"):
        u.train(str(u.LLAMA_3B_CONFIG), {"max_steps": 1})
    loaded = set(sys.modules) - before
    assert not {"unsloth", "unsloth_zoo", "trl", "peft"} & loaded


@no_cuda
def test_a_4bit_model_saved_merged_is_refused_on_the_cpu_backend(unsloth_env):
    if _driver_loaded():
        pytest.skip("an NVIDIA driver is loaded here: Unsloth would refuse the CPU fallback")
    reason = u.check_can_train(u.TINY_CONFIG, {"load_in_4bit": True})
    assert reason is not None
    assert reason.startswith("Unsloth needs a CUDA GPU to merge LoRA into a 4-bit model: torch ")
    assert u.check_can_train(u.TINY_CONFIG, {"load_in_4bit": True, "save_method": "lora"}) is None


def test_forcing_the_cpu_backend_is_refused_by_a_gpu_only_config(unsloth_env):
    unsloth_env.setenv("UNSLOTH_FORCE_CPU", "1")
    assert u.backend() == "cpu"
    assert u.check_can_train(u.TINY_CONFIG) is None
    reason = u.check_can_train(u.LLAMA_3B_CONFIG)
    assert reason is not None and "UNSLOTH_FORCE_CPU=1" in reason


def test_overrides_replace_keys_and_name_unknown_ones():
    config = u.load_config(
        u.TINY_CONFIG,
        {
            "model_name": "/models/tiny",
            "dataset": "/data/train.jsonl",
            "output_dir": "/out",
            "max_steps": 3,
            "lora.r": 8,
        },
    )
    assert config["model_name"] == "/models/tiny" and config["output_dir"] == "/out"
    assert config["dataset"] == {"path": "/data/train.jsonl", "split": "train", "max_samples": 256}
    assert config["training"]["max_steps"] == 3 and config["lora"]["r"] == 8
    assert u.load_config(u.TINY_CONFIG)["training"]["max_steps"] == 8  # the file is unchanged
    with pytest.raises(ValueError, match="unknown override 'max_stepz'"):
        u.load_config(u.TINY_CONFIG, {"max_stepz": 3})


def test_pipeline_overrides_fill_in_what_the_pipeline_owns():
    overrides = u.pipeline_overrides(
        base_model="/runs/base",
        tokenizer="data/tokenizer",
        data="/runs/train.jsonl",
        output_dir="/runs/model",
        max_steps=5,
        max_length=64,
    )
    config = u.load_config(u.LLAMA_3B_CONFIG, overrides)
    assert config["model_name"] == "/runs/base" and config["tokenizer_name"] == "data/tokenizer"
    assert config["dataset"]["path"] == "/runs/train.jsonl"
    assert config["output_dir"] == "/runs/model"
    assert config["training"]["max_steps"] == 5 and config["max_seq_length"] == 64
    same = u.pipeline_overrides(
        base_model="m", tokenizer="m", data="d", output_dir="o", max_steps=None, max_length=None
    )
    assert same == {"model_name": "m", "dataset": "d", "output_dir": "o"}


# ------------------------------------------------------------------ .venvs/unsloth


def _venv_python(code: str, env: dict[str, str], timeout: float = 180):
    return subprocess.run(
        [str(VENV_PYTHON), "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNSLOTH_")}
    env.update(extra)
    return env


@needs_venv
@no_cuda
def test_import_unsloth_without_a_gpu_selects_its_cpu_backend():
    if _driver_loaded():
        pytest.skip("an NVIDIA driver is loaded here: Unsloth would refuse the CPU fallback")
    done = _venv_python(
        "import unsloth; print('DEVICE', unsloth.DEVICE_TYPE, unsloth.__version__)", _clean_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert CPU_BANNER in done.stdout
    assert "Set UNSLOTH_DISABLE_CPU_FALLBACK=1 to raise instead." in done.stdout
    assert "DEVICE cpu 2026.10." in done.stdout


@needs_venv
@no_cuda
def test_import_unsloth_with_the_cpu_fallback_disabled_raises():
    done = _venv_python("import unsloth", _clean_env(UNSLOTH_DISABLE_CPU_FALLBACK="1"))
    assert done.returncode == 1
    assert done.stderr.rstrip().splitlines()[-1] == NO_FALLBACK


@pytest.mark.slow
@needs_venv
@no_cuda
def test_tiny_config_trains_on_two_cpu_ranks_and_saves_a_model_our_env_loads(tmp_path):
    if _driver_loaded():
        pytest.skip("an NVIDIA driver is loaded here: Unsloth would refuse the CPU fallback")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done, results, base = run_tiny_config(tmp_path, 2, max_steps=4, env=_clean_env(), timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert CPU_BANNER in done.stdout
    for result in results:
        assert result["device"] == "cpu" and result["world_size"] == 2
        assert result["steps"] == 4 and len(result["loss_history"]) == 4
        assert math.isfinite(result["train_loss"])
        assert result["save_method"] == "merged_16bit"
    assert results[0]["train_loss"] == results[1]["train_loss"]  # averaged over the ranks

    folder = Path(results[0]["output_dir"])
    assert folder == tmp_path / "out" / "merged_16bit"
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    start = AutoModelForCausalLM.from_pretrained(base)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "add 4 2"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=False,  # transformers 5 returns the encoding unless asked for the ids
    )
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    # The LoRA update is merged into the weights (merged_16bit: stored as 16-bit).
    name = "model.layers.0.self_attn.q_proj.weight"
    trained, initial = model.state_dict()[name], start.state_dict()[name]
    # transformers 5 loads a model in the dtype it was stored in (16-bit here).
    assert trained.dtype == torch.bfloat16
    assert not torch.allclose(trained.float(), initial.to(torch.bfloat16).float(), atol=1e-3)
