"""SFT pipeline tasks: evaluate before/after, register (alias only past the gate), show progress."""

import base64
import contextlib
import contextvars
import json
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE

from trainflow import tracking
from trainflow.data import PreparedDataset
from trainflow.data.tokenizer import load_tokenizer
from trainflow.workloads import sft


@task(name="evaluate-sft", cache_policy=NO_CACHE)
def evaluate_sft(config: sft.SFTConfig, data: PreparedDataset, output_dir: str) -> dict[str, float]:
    """Held-out loss, perplexity and exact match of the trained and the untrained model."""
    return sft.evaluate(config, data, output_dir)


@task(name="register-sft-model", cache_policy=NO_CACHE)
def register_sft_model(
    run_id: str,
    config: sft.SFTConfig,
    data: PreparedDataset,
    output_dir: str,
    tags: Mapping[str, str],
    champion: bool,
) -> str:
    """Log the trained model (LoRA merged) with `mlflow.transformers`, register it, and give
    it the alias `champion` when it passed the gate; returns the version."""
    model = sft.load_model(config, output_dir, trained=True)
    tokenizer = load_tokenizer(config.tokenizer_path())
    name = config.registered_model_name
    version = tracking.register_transformers_model(
        run_id, model, tokenizer, name, sft.prompt_example(config, data), tags
    )
    if champion:
        tracking.set_alias(name, version, "champion")
    return version


@task(name="publish-loss-curve", cache_policy=NO_CACHE)
def publish_loss_curve(run_id: str, history: dict[int, dict[str, float]], output_dir: str) -> str:
    """Plot the training loss, attach the PNG to the MLflow run and show it in Prefect."""
    png = sft.plot_loss_curve(history, Path(output_dir) / "loss_curve.png")
    tracking.log_artifact(run_id, png)
    encoded = base64.b64encode(png.read_bytes()).decode()
    return str(
        create_markdown_artifact(
            key="sft-loss-curve",
            markdown=f"# SFT training loss\n\n![loss curve](data:image/png;base64,{encoded})\n",
            description="Training loss by step",
        )
    )


@contextlib.contextmanager
def training_progress(output_dir: str, poll_s: float = 2.0) -> Iterator[None]:
    """A progress artifact that follows rank 0's progress file while the block runs.

    Ranks never talk to Prefect: rank 0 writes `progress.json` and this thread forwards it.
    """
    artifact_id = create_progress_artifact(
        progress=0.0, key="sft-progress", description="Training steps done (%)"
    )
    progress_file = Path(output_dir) / sft.PROGRESS_FILE
    stop = threading.Event()

    def forward() -> None:
        last = -1.0
        while not stop.wait(poll_s):
            with contextlib.suppress(OSError, ValueError, KeyError):
                state = json.loads(progress_file.read_text())
                done = 100.0 * state["step"] / state["max_steps"]
                if done != last:
                    update_progress_artifact(artifact_id, done)
                    last = done

    # The thread runs in this flow's context: same Prefect settings and client as the flow.
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(forward,), name="sft-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(OSError, ValueError, KeyError):
            state = json.loads(progress_file.read_text())
            update_progress_artifact(artifact_id, 100.0 * state["step"] / state["max_steps"])
