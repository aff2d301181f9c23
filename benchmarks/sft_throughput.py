"""SFT training throughput: the pipeline's training step vs a plain `torchrun` + `SFTTrainer`.

Both train the same tiny Llama (same seed) on the shipped instruction data with the same
tokenizer, batch, steps and optimizer on 2 ranks; the plain side reads all rows of the JSONL,
the pipeline its prepared train split (the same rows less the 10% held out). The pipeline
side runs `trainflow.workloads.sft.train` under our launcher with DDP, reading the prepared
MDS shards and logging to a real MLflow run from rank 0; the plain side is a script that
hands the JSONL to `SFTTrainer` itself (`assistant_only_loss`). Tokens/s counts the tokens
seen per second of `train_runtime` (start-up excluded on both sides). Prints one JSON line::

    python -m benchmarks.sft_throughput [--steps 60] [--gpus 2]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def plain(steps: int, out: str) -> None:
    """Rank body of the plain script (run by torchrun)."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    from trainflow.data.tokenizer import load_tokenizer
    from trainflow.models.causal_lm import build_causal_lm
    from trainflow.workloads.sft import load_sft_preset

    config = load_sft_preset("debug_cpu")
    t = config.training
    tokenizer = load_tokenizer(str(REPO_ROOT / "data" / "tokenizer"))
    model = build_causal_lm(config.model, tokenizer, seed=t.seed)
    rows = datasets.load_dataset(
        "json", data_files=str(REPO_ROOT / "data" / "instructions.jsonl"), split="train"
    )
    on_cpu = os.environ.get("TRAINFLOW_DEVICE", "cpu") == "cpu"
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(
            output_dir=tempfile.mkdtemp(),
            max_steps=steps,
            per_device_train_batch_size=t.per_device_batch_size,
            learning_rate=t.optimizer.learning_rate,
            warmup_steps=t.warmup_steps,
            lr_scheduler_type=t.lr_scheduler,
            logging_steps=t.logging_steps,
            save_strategy="no",
            report_to=[],
            max_length=config.max_length,
            assistant_only_loss=True,
            use_cpu=on_cpu,
            ddp_backend="gloo" if on_cpu else "nccl",
            disable_tqdm=True,
        ),
        train_dataset=rows.select_columns(["messages"]),
        processing_class=tokenizer,
    )
    output = trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        tokens = max(h.get("num_tokens", 0.0) for h in trainer.state.log_history)
        Path(out).write_text(
            json.dumps({"tokens": tokens, "runtime_s": output.metrics["train_runtime"]})
        )


def pipeline_step(steps: int, gpus: int) -> dict[str, float]:
    """The pipeline's training step: prepared shards, our launcher, DDP, rank-0 MLflow sink."""
    from trainflow import launch
    from trainflow.data import prepare_dataset
    from trainflow.paths import trainflow_home
    from trainflow.strategies.job import Workload, run_on_rank
    from trainflow.tracking import pipeline_run
    from trainflow.workloads import sft

    config = sft.SFTConfig.model_validate(
        sft.load_sft_preset("debug_cpu").model_dump() | {"max_steps": steps, "gpus": gpus}
    )
    data = prepare_dataset(config.data_config())
    with pipeline_run("sft-benchmark", "throughput", params={}) as run_id:
        workload = Workload(
            train_fn=sft.train,
            model_fn=sft.build_model,
            config=sft.SFTJob(config=config, data=data),
            output_dir=str(trainflow_home() / "outputs" / "sft-benchmark" / run_id),
            framework="hf",
            mlflow_run_id=run_id,
        )
        result = launch(
            run_on_rank,
            (workload, config.technique),
            options=config.resources.launch_options(),
            on_line=lambda rank, line: print(f"[rank {rank}] {line}", file=sys.stderr),
        ).values[0]
    m = result.metrics
    return {
        "tokens": m["train_num_tokens"],
        "runtime_s": m["train_runtime"],
        "data_wait_s": m["train_data_wait_s"],
        "logging_s": m["train_logging_s"],
    }


def plain_step(steps: int, gpus: int) -> dict[str, float]:
    """The same training in a plain script under `torchrun`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "plain.json")
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            + [f"--nproc-per-node={gpus}", "-m", "benchmarks.sft_throughput"]
            + ["--plain-rank", out, "--steps", str(steps)],
            cwd=REPO_ROOT,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
            check=True,
            capture_output=True,
        )
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per side")
    parser.add_argument("--gpus", type=int, default=2, help="ranks per side")
    parser.add_argument("--plain-rank", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_rank:
        plain(args.steps, args.plain_rank)
        return
    ours = pipeline_step(args.steps, args.gpus)
    base = plain_step(args.steps, args.gpus)
    ours_tps = ours["tokens"] / ours["runtime_s"]
    base_tps = base["tokens"] / base["runtime_s"]
    print(
        json.dumps(
            {
                "benchmark": "sft_throughput",
                "ranks": args.gpus,
                "steps": args.steps,
                "pipeline_tokens_per_s": round(ours_tps, 1),
                "plain_torchrun_tokens_per_s": round(base_tps, 1),
                "pipeline_vs_plain": round(ours_tps / base_tps, 3),
                "data_wait_share": round(ours["data_wait_s"] / ours["runtime_s"], 4),
                "logging_share": round(ours["logging_s"] / ours["runtime_s"], 4),
            }
        )
    )


if __name__ == "__main__":
    main()
