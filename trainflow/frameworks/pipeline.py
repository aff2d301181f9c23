"""The main environment's side of a framework run: its inputs, its evaluation, its model card.

The ranks run the framework in its own environment (`trainflow.frameworks.NAME.train`); what
happens before and after them happens here, in the pipeline's process, with our libraries.
This module is the framework pipelines' workload for the pipeline skeleton: its `evaluate`
and `log_model` are the hooks the skeleton calls after training (`FrameworkWorkload.load`).
"""

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainflow import tracking
from trainflow.configs.frameworks import Framework, FrameworkConfig
from trainflow.data import DataConfig
from trainflow.models.causal_lm import is_tiny
from trainflow.strategies.job import TrainResult, local_path
from trainflow.workloads import Evaluation


@dataclass(frozen=True)
class FrameworkJob:
    """What the framework's ranks and the evaluation get: the config (resolved, its framework
    set), the prepared dataset, and the inputs staged in the run's folder (`with_inputs`)."""

    config: FrameworkConfig
    data_uri: str
    base_model: str = ""  # the model folder or Hub id the framework starts from
    train_data: str = ""  # the training data as the framework reads it (JSONL, or MDS)

    def with_inputs(self, base_model: str, train_data: str) -> "FrameworkJob":
        return dataclasses.replace(self, base_model=base_model, train_data=train_data)


def stage_inputs(job: FrameworkJob, out: Path) -> FrameworkJob:
    """The job with its base model and data where the framework reads them, under `out`: the
    tiny model saved as a model folder; the prepared MDS dataset, or its training rows as
    chat JSONL."""
    config = job.config
    base_model = stage_base_model(config, out / "base_model")
    if config.technique.data_format == "mds":
        return job.with_inputs(base_model, job.data_uri)
    data = export_chat_jsonl(config.data_config(), out / "data" / "train.jsonl")
    return job.with_inputs(base_model, str(data))


def stage_base_model(config: FrameworkConfig, out: Path) -> str:
    """The base model as the framework will load it: a tiny model is built here from its config
    (seeded, with the shipped tokenizer) and saved to `out`; a Hub id or folder is passed on."""
    if not is_tiny(config.base_model):
        return config.base_model
    if (out / "config.json").is_file():
        return str(out)  # a retry of this run: the same seeded weights are already there
    return save_tiny_model(config.base_model, config.tokenizer_path(), out)


def save_tiny_model(name: str, tokenizer_path: str, out: Path, seed: int = 0) -> str:
    """Build the tiny architecture `name` (`tiny-llama`) with its tokenizer, seeded, and save
    both as one model folder at `out`, whole or not at all; returns the folder."""
    from trainflow.data.tokenizer import load_tokenizer
    from trainflow.models.causal_lm import build_causal_lm

    tokenizer = load_tokenizer(tokenizer_path)
    model = build_causal_lm(name, tokenizer, seed=seed)
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    os.replace(partial, out)
    return str(out)


def export_chat_jsonl(data: DataConfig, path: Path) -> Path:
    """The training split's conversations as JSONL (`{"messages": [...]}` per line), for a
    framework that reads chat files: the very rows our data task put in the training split, so
    the held-out split stays unseen. Written whole, then renamed into place."""
    from trainflow.data.sources import load_source

    rows = load_source(data)["train"]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        for messages in rows["messages"]:
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    os.replace(partial, path)
    return path


def trained_model_dir(result: dict[str, Any]) -> Path:
    """The Hugging Face model folder the ranks reported, checked to hold a model."""
    folder = Path(result.get("model_dir") or result["output_dir"])
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"the framework reported {folder} as its trained model, but it holds no config.json"
        )
    return folder


def train_result(framework: Framework, result: dict[str, Any]) -> TrainResult:
    """Rank 0's report as the skeleton's `TrainResult`: the saved model, steps, loss history."""
    distributed = result.get("distributed") or {}
    return TrainResult(
        technique=framework.name,
        world_size=int(result.get("world_size") or 1),
        wrapped_as=str(distributed.get("model_wrapper") or framework.title),
        steps=int(result.get("global_step") or 0),
        metrics=train_metrics(result),
        history={int(step): {"train_loss": float(loss)} for step, loss in result["loss_history"]},
        checkpoint_uri=None,
        model_uri=trained_model_dir(result).as_uri(),
    )


def train_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The numbers of rank 0's report that are metrics."""
    names = {
        "train_loss": "train_loss",
        "global_step": "steps",
        "train_runtime_s": "train_runtime_s",
    }
    return {
        name: float(result[key])
        for key, name in names.items()
        if isinstance(result.get(key), int | float)
    }


def installed_version(python: Path, distribution: str) -> str:
    """The version of `distribution` installed in `python`'s environment (read from its
    metadata, nothing imported), or "unknown"."""
    import importlib.metadata

    prefix = python.parent.parent
    for site in sorted(prefix.glob("lib/python*/site-packages")):
        for found in importlib.metadata.distributions(name=distribution, path=[str(site)]):
            return str(found.version)
    return "unknown"


def evaluate(job: FrameworkJob, trained: TrainResult) -> Evaluation:
    """Held-out metrics of the trained model and of the model it started from (the
    skeleton's `evaluate` hook); the model and an input example for registration."""
    model_dir = local_path(trained.model_uri)
    metrics, model, example = score(job.config, job.data_uri, job.base_model, model_dir)
    return Evaluation(metrics, model=model, input_example=example, model_dir=model_dir)


def log_model(
    job: FrameworkJob, evaluation: Evaluation, run_id: str, name: str, tags: dict[str, str]
) -> str:
    """Log the trained model to the run with its tokenizer and card, and register it as
    `name` with `tags` (the skeleton's `log_model` hook); the version."""
    from trainflow.data.tokenizer import load_tokenizer

    config, trained = job.config, evaluation.model_dir
    if trained is None:
        raise ValueError("the evaluation names no trained model folder to register")
    return tracking.register_transformers_model(
        run_id,
        evaluation.model,
        load_tokenizer(config.tokenizer_path()),
        name,
        evaluation.input_example,
        tags,
        card=model_card(config.technique, config, evaluation.metrics, tags),
        # The framework's folder may hold more than the model (its checkpoints, logs): the
        # model is saved again, beside it on the run's disk, unless the folder is the model.
        checkpoint=trained if tracking.registrable_as_is(trained, evaluation.model) else None,
        scratch_dir=trained.parent,
    )


def score(
    config: FrameworkConfig, data_uri: str, base_model: str, trained: Path
) -> tuple[dict[str, float], Any, str]:
    """Held-out metrics of the trained model (`eval_*`) and of the model it started from
    (`untrained_*`), on our validation split; the trained model and an input example, for
    registration."""
    from transformers import AutoModelForCausalLM

    from trainflow.data.tokenizer import load_tokenizer
    from trainflow.evaluation import trained_vs_untrained
    from trainflow.workloads.sft import read_split

    e = config.evaluation
    return trained_vs_untrained(
        lambda: AutoModelForCausalLM.from_pretrained(base_model).eval(),
        lambda: AutoModelForCausalLM.from_pretrained(str(trained)).eval(),
        load_tokenizer(config.tokenizer_path()),
        read_split(data_uri, "validation", e.num_samples),
        batch_size=e.batch_size,
        max_new_tokens=e.max_new_tokens,
    )


def model_card(
    framework: Framework, config: FrameworkConfig, metrics: dict[str, float], tags: dict[str, str]
) -> str:
    """The registered model's card: the framework, its config, the data and the scores."""
    scores = "\n".join(f"| {k} | {v:.4f} |" for k, v in sorted(metrics.items()))
    return (
        "---\nlibrary_name: transformers\npipeline_tag: text-generation\n"
        f"tags: [trainflow, {framework.name}]\n---\n\n"
        f"# {config.registered_model_name}\n\n"
        f"Trained by {framework.title} ({tags.get('framework_version', 'unknown version')}) "
        f"from `{config.model}` on `{config.dataset}` with its config "
        f"`{Path(config.framework_config).name}`, on {config.gpus} {config.gpu_type or 'GPU'} "
        f"rank(s) (MLflow run `{tags.get('mlflow_run_id', '')}`).\n\n"
        f"| metric | value |\n|---|---|\n{scores}\n"
    )
