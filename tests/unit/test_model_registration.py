"""A causal LM registered with `tracking.register_transformers_model` loads and generates.

MLflow checks a logged model by serving its input example only when it is given the model
object; the pipeline gives it a saved checkpoint, so this test does that check itself: the
registered version, loaded back from the registry as any user would, answers the prompt.
Against a real SQLite store (the test's own, see conftest).
"""

import tempfile
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from trainflow import tracking
from trainflow.data.tokenizer import load_tokenizer
from trainflow.models.causal_lm import build_causal_lm
from trainflow.workloads import sft


def test_registered_checkpoint_loads_from_the_registry_and_generates(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    tokenizer = load_tokenizer(sft.SHIPPED_TOKENIZER)
    model = build_causal_lm("tiny-llama", tokenizer, seed=0).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], tokenize=False, add_generation_prompt=True
    )
    card = "---\nlibrary_name: transformers\n---\n\n# tiny\n\nA card written by the pipeline.\n"

    with tracking.pipeline_run("registration", "register", params={}) as run_id:
        version = tracking.register_transformers_model(
            run_id, model, tokenizer, "tiny-registered", prompt, {"technique": "ddp"}, card=card
        )

    assert version == "1"
    client = MlflowClient(tracking_uri=tracking.tracking_uri())
    assert client.get_model_version("tiny-registered", "1").tags["technique"] == "ddp"
    info = mlflow.models.get_model_info("models:/tiny-registered/1")
    flavor = info.flavors["transformers"]
    assert flavor["task"] == "text-generation" and flavor["torch_dtype"] == str(torch.float32)
    assert info.signature is not None and info.saved_input_example_info is not None
    loaded = mlflow.pyfunc.load_model("models:/tiny-registered/1")
    answer = loaded.predict([prompt], params={"max_new_tokens": 4})
    assert isinstance(answer, list) and len(answer) == 1 and isinstance(answer[0], str)
    local = Path(mlflow.artifacts.download_artifacts("models:/tiny-registered/1"))
    assert "A card written by the pipeline." in (local / "model_card.md").read_text()
    weights = local / "model" / "model.safetensors"
    assert weights.is_file()
    # The checkpoint MLflow logged from was a temporary folder: nothing of it is left.
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_full_fine_tunes_folder_is_registered_as_it_is(tmp_path, monkeypatch):
    # The ranks' output of a full fine-tune holds the model: MLflow logs that folder, and no
    # copy of the model is written anywhere else (the temp folder stays empty).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    tokenizer = load_tokenizer(sft.SHIPPED_TOKENIZER)
    folder = tmp_path / "run" / "model"
    build_causal_lm("tiny-llama", tokenizer, seed=1).save_pretrained(folder)  # no tokenizer
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert tracking.registrable_as_is(folder, model)
    prompt = "Name a colour."

    with tracking.pipeline_run("registration", "register", params={}) as run_id:
        version = tracking.register_transformers_model(
            run_id, model, tokenizer, "tiny-folder", prompt, {}, checkpoint=folder
        )

    assert (folder / "tokenizer_config.json").is_file()  # added, so the folder loads alone
    local = Path(mlflow.artifacts.download_artifacts(f"models:/tiny-folder/{version}"))
    logged = (local / "model" / "model.safetensors").read_bytes()
    assert logged == (folder / "model.safetensors").read_bytes()
    answer = mlflow.pyfunc.load_model(f"models:/tiny-folder/{version}").predict(
        [prompt], params={"max_new_tokens": 2}
    )
    assert isinstance(answer[0], str)
    assert not any(p.name.startswith("tiny-folder") for p in (tmp_path / "tmp").iterdir())


def test_a_changed_or_crowded_folder_is_not_registered_as_it_is(tmp_path):
    tokenizer = load_tokenizer(sft.SHIPPED_TOKENIZER)
    folder = tmp_path / "model"
    build_causal_lm("tiny-llama", tokenizer, seed=1).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert tracking.registrable_as_is(folder, model)
    changed = AutoModelForCausalLM.from_pretrained(folder)
    changed.config.output_router_logits = False  # what load_model turns off for inference
    assert not tracking.registrable_as_is(folder, changed)
    (folder / "checkpoint-10").mkdir()  # a framework's checkpoint beside its model
    assert not tracking.registrable_as_is(folder, model)
    (folder / "checkpoint-10").rmdir()
    (folder / "adapter_config.json").write_text("{}")  # a LoRA adapter's folder
    assert not tracking.registrable_as_is(folder, model)


def test_a_model_without_a_folder_is_saved_in_the_scratch_folder_and_removed(tmp_path):
    tokenizer = load_tokenizer(sft.SHIPPED_TOKENIZER)
    model = build_causal_lm("tiny-llama", tokenizer, seed=0).eval()
    scratch = tmp_path / "run"
    with tracking.pipeline_run("registration", "register", params={}) as run_id:
        tracking.register_transformers_model(
            run_id, model, tokenizer, "tiny-scratch", "Hi", {}, scratch_dir=scratch
        )
    assert scratch.is_dir() and list(scratch.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="no config.json"):
        tracking.register_transformers_model(
            run_id, model, tokenizer, "tiny-scratch", "Hi", {}, checkpoint=tmp_path / "empty"
        )


def test_a_model_too_big_for_the_gpu_is_evaluated_on_the_cpu_mocked_gpu(monkeypatch, capsys):
    """Rank 0 evaluates on its GPU; a model that does not fit there (a GPU is mocked: moving
    to it raises CUDA's out-of-memory error) is evaluated where it was loaded."""
    model = torch.nn.Linear(2, 2)
    moved_to: list[str] = []

    def to(device, *args, **kwargs):
        moved_to.append(str(device))
        if str(device).startswith("cuda"):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return model

    monkeypatch.setattr(model, "to", to)
    assert sft._onto(model, torch.device("cuda", 0)) is model
    assert moved_to == ["cuda:0", "cpu"]
    assert "does not fit cuda:0 for evaluation: evaluating on the CPU" in capsys.readouterr().out
