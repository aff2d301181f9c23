"""The main environment's side of a framework run: its inputs, its evaluation, its model card.

The ranks run the framework in its own environment (`trainflow.frameworks.NAME.train`); what
happens before and after them happens here, in the pipeline's process, with our libraries.
"""

import json
import os
from pathlib import Path
from typing import Any

from trainflow.configs.frameworks import Framework, FrameworkConfig
from trainflow.data import DataConfig
from trainflow.models.causal_lm import is_tiny


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


def evaluate(
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
