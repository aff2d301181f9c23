"""A model of about a gigabyte logged, registered and loaded back through an MLflow tracking
server (artifacts proxied to the object store, in parts), side by side with the same model
logged to a local MLflow store on this machine's disk.

The model is a Llama built from a config with random weights (no hub): `--hidden 2048` and
`--layers 3` make 285M float32 parameters, 1.14 GB of safetensors. It goes through the pipeline's
own registration (`trainflow.tracking.register_transformers_model`, as `flows.sft` registers), is
loaded back with `mlflow.transformers.load_model` from `models:/NAME/VERSION`, and every tensor is
compared with the original (`torch.equal`).

    python -m deployments.stack up && eval "$(python -m deployments.stack env)"
    python -m benchmarks.large_model            # server vs a local store
    python -m benchmarks.large_model --server-only

The last line of stdout is one JSON object: sizes, seconds to log+register and to load, each
side, and `server_over_local`, the ratio of the log+register times.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def build_model(hidden: int, layers: int) -> tuple[Any, Any]:
    """A config-built Llama with random weights and a tiny local tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainflow.data.tokenizer import train_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=max(1, hidden // 128),
        tie_word_embeddings=False,
    )
    tokenizer = train_tokenizer(["a tokenizer for a model logged as a test"] * 8, vocab_size=300)
    return LlamaForCausalLM(config), tokenizer


def model_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def log_register_load(model: Any, tokenizer: Any, name: str, scratch: Path) -> dict[str, Any]:
    """Log and register `model` to the current tracking URI, load it back, compare it."""
    import mlflow
    import torch

    from trainflow import tracking

    mlflow.set_tracking_uri(tracking.tracking_uri())
    mlflow.set_experiment("large-model")
    run = mlflow.start_run()
    mlflow.end_run()
    started = time.perf_counter()
    version = tracking.register_transformers_model(
        run.info.run_id, model, tokenizer, name, "hello", {}, scratch_dir=scratch
    )
    logged = time.perf_counter() - started
    started = time.perf_counter()
    loaded = mlflow.transformers.load_model(f"models:/{name}/{version}", return_type="components")
    load_s = time.perf_counter() - started
    theirs = loaded["model"].state_dict()
    mine = model.state_dict()
    same = set(theirs) == set(mine) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    return {
        "version": version,
        "log_register_s": round(logged, 1),
        "load_s": round(load_s, 1),
        "identical": same,
        "tensors": len(mine),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=2048, help="Hidden size of the model.")
    parser.add_argument("--layers", type=int, default=3, help="Decoder layers of the model.")
    parser.add_argument("--name", default="large-model", help="Registered model name.")
    parser.add_argument("--server-only", action="store_true", help="Skip the local-store side.")
    args = parser.parse_args(argv)
    server = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not server.startswith("http"):
        parser.error(
            "MLFLOW_TRACKING_URI is not a tracking server: "
            'eval "$(python -m deployments.stack env)" first'
        )
    model, tokenizer = build_model(args.hidden, args.layers)
    size = model_bytes(model)
    print(f"model: {size / 1e9:.2f} GB of float32 weights", file=sys.stderr)
    report: dict[str, Any] = {"benchmark": "large_model", "model_gb": round(size / 1e9, 2)}
    scratch = Path(tempfile.mkdtemp(prefix="large-model-"))
    # MLflow downloads a model it loads from a server (and, again, its MLmodel file) to
    # temporary folders it never removes: this process's temporary folders go into the
    # scratch folder, removed at the end.
    tempfile.tempdir = str(scratch)
    try:
        report["server"] = log_register_load(model, tokenizer, args.name, scratch / "server")
        if not args.server_only:
            local = scratch / "local-store"
            os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{local / 'mlflow.db'}"
            local.mkdir()
            cwd = os.getcwd()
            os.chdir(local)  # the local store's artifacts go beside its database
            try:
                report["local"] = log_register_load(model, tokenizer, args.name, scratch / "l")
            finally:
                os.chdir(cwd)
                os.environ["MLFLOW_TRACKING_URI"] = server
            report["server_over_local"] = round(
                report["server"]["log_register_s"] / report["local"]["log_register_s"], 2
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
