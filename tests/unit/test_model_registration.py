"""A causal LM registered with `tracking.register_transformers_model` loads and generates.

MLflow checks a logged model by serving its input example only when it is given the model
object; the pipeline gives it a saved checkpoint, so this test does that check itself: the
registered version, loaded back from the registry as any user would, answers the prompt.
Against a real SQLite store (the test's own, see conftest).
"""

import tempfile
from pathlib import Path

import mlflow
import torch
from mlflow.tracking import MlflowClient

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
