"""Each GPU preset's tiny twin (`tiny_twin`) end to end through `python -m flows.sft`: the
preset's technique, LoRA, precision and checkpointing settings on the tiny model of its family,
2 gloo CPU ranks, the shipped data, a real Prefect server and a temporary MLflow store.

The presets themselves need GPUs and network; these runs check that the recipe's settings go
through the pipeline (memory plan, technique, Trainer arguments, registration)."""

import pytest
import yaml

from flows import sft as pipeline
from trainflow import tracking
from trainflow.configs.sft import load_sft_preset, tiny_twin

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("preset", "extra", "wrapped", "params"),
    [
        # auto on CPU ranks is not checked and takes the first candidate, DDP: the preset's own
        # technique, so this run is the twin and the auto path at once.
        (
            "gpt-oss-20b",
            ["--technique", "auto"],
            "DistributedDataParallel",
            {
                "technique.name": "ddp",
                "memory.technique_requested": "auto",
                "memory.technique_chosen": "ddp",
                "lora": "True",
                "gradient_checkpointing": "True",
                "precision": "fp32",
            },
        ),
        (
            "gpt-oss-120b",
            [],
            "FSDP",
            {
                "technique.name": "fsdp",
                "memory.technique_requested": "fsdp",
                "technique.activation_checkpointing": "True",
                "technique.reshard_after_forward": "True",
                "technique.mixed_precision": "fp32",
                "cpu_ram_efficient_loading": "True",
                "lora": "True",
            },
        ),
        (
            "llama-3.2-1b-zero3",
            [],
            "DeepSpeedEngine",
            {
                "technique.name": "deepspeed",
                "technique.zero_stage": "3",
                "technique.mixed_precision": "fp32",
                "lora": "False",
            },
        ),
    ],
)
def test_preset_tiny_twin_trains_and_registers(
    prefect_api, tmp_path, caplog, preset, extra, wrapped, params
):
    config = load_sft_preset(preset)
    twin = tiny_twin(config)
    assert twin.model == ("tiny-gpt-oss" if "gpt-oss" in preset else "tiny-llama")
    assert (twin.lora, twin.lora_settings) == (config.lora, config.lora_settings)
    assert twin.technique.name == config.technique.name
    path = tmp_path / "twin.yaml"
    path.write_text(yaml.safe_dump(twin.model_dump(mode="json")))

    result = pipeline.main(["--config", str(path), *extra])

    out = caplog.text  # the flow's prints are its run logs
    assert "memory estimate: " in out and "not checked (CPU ranks)" in out
    if "auto" in extra:
        assert "technique auto -> ddp" in out
    assert f"trained as {wrapped}" in out  # what the Trainer really wrapped, from rank 0
    assert result.technique == config.technique.name and result.model_version == "1"
    m = result.metrics
    assert m["eval_loss"] < m["untrained_loss"]
    client = tracking.store_client()
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    logged = run.data.params
    assert {k: logged.get(k) for k in params} == params
    assert logged["model"] == twin.model and logged["max_steps"] == str(twin.max_steps)
    assert float(logged["memory.estimate_gb"]) > 0 and logged["memory.available_gb"] == "none"
    version = client.get_model_version(f"{config.registered_model_name}-tiny", "1")
    assert version.tags["technique"] == config.technique.name
