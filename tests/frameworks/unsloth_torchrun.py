"""Run Unsloth's tiny config with torchrun from .venvs/unsloth, as the Unsloth tests do."""

import json
import subprocess
from pathlib import Path

from tests.conftest import REPO_ROOT
from trainflow.frameworks import unsloth as u
from trainflow.frameworks.pipeline import save_tiny_model

VENV_BIN = REPO_ROOT / ".venvs" / "unsloth" / "bin"


def run_tiny_config(
    tmp_path: Path, nproc: int, max_steps: int, env: dict[str, str], timeout: float
) -> tuple[subprocess.CompletedProcess, list[dict], str]:
    """Train unsloth-tiny.yaml on `nproc` ranks (`python -m trainflow.frameworks.unsloth` under
    torchrun) on a tiny Llama saved to `tmp_path`; the process, each rank's result (empty if it
    failed) and the base model folder."""
    base = save_tiny_model("tiny-llama", str(REPO_ROOT / "data" / "tokenizer"), tmp_path / "base")
    overrides = {"model_name": base, "output_dir": str(tmp_path / "out"), "max_steps": max_steps}
    done = subprocess.run(
        [
            str(VENV_BIN / "torchrun"),
            *("--nproc_per_node", str(nproc), "--rdzv-backend", "c10d"),
            *("--log-dir", str(tmp_path / "torchrun")),  # torchrun's own: not in /tmp
            *("--rdzv-endpoint", "localhost:0", "-m", "trainflow.frameworks.unsloth"),
            str(u.TINY_CONFIG),
            *("--overrides", json.dumps(overrides), "--result-dir", str(tmp_path / "results")),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    results = []
    if done.returncode == 0:
        results = [
            json.loads((tmp_path / "results" / f"rank{r}.json").read_text()) for r in range(nproc)
        ]
    return done, results, base
