"""The two-tower recommender as an MLflow pyfunc: what the registry serves.

    model = mlflow.pyfunc.load_model("models:/two_tower@champion")
    model.predict(pd.DataFrame({"user_id": [3, 3], "item_id": [41, 7]}))    # click probability
    model.predict(pd.DataFrame({"user_id": [3]}), params={"top_k": 10})     # best 10 items

Both answer with rows `(user_id, item_id, score)`; top-k rows come best first per user. The
model carries its weights, tower sizes and item-category table as artifacts, and needs only
torch and this package to load. Imported when a model is logged or loaded, never on a rank.
"""

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import torch
from mlflow.models import ModelSignature
from mlflow.pyfunc import PythonModel, PythonModelContext
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

from trainflow import tracking
from trainflow.models.two_tower import TwoTower

SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("long", "user_id"), ColSpec("long", "item_id", required=False)]),
    outputs=Schema(
        [ColSpec("long", "user_id"), ColSpec("long", "item_id"), ColSpec("double", "score")]
    ),
    params=ParamSchema([ParamSpec("top_k", "long", 0)]),
)


class TwoTowerRecommender(PythonModel):
    """Scores (user, item) pairs, or with `top_k > 0` ranks every item for each user given."""

    def load_context(self, context: PythonModelContext) -> None:
        spec = json.loads(Path(context.artifacts["spec"]).read_text())
        self.model = TwoTower(**spec["towers"])
        weights = torch.load(context.artifacts["weights"], map_location="cpu", weights_only=True)
        self.model.load_state_dict(weights)
        self.model.eval()
        self.categories = torch.tensor(spec["item_categories"])

    @torch.no_grad()
    def predict(
        self,
        context: PythonModelContext,
        model_input: pd.DataFrame,
        params: dict[str, Any] | None = None,
    ) -> pd.DataFrame:
        top_k = int((params or {}).get("top_k") or 0)
        users = torch.tensor(model_input["user_id"].to_numpy(), dtype=torch.long)
        if top_k > 0:
            wanted = torch.unique(users)
            scores = torch.sigmoid(self.model.score_all(wanted, self.categories))
            best = torch.topk(scores, min(top_k, scores.shape[1]), dim=1)
            return pd.DataFrame(
                {
                    "user_id": wanted.repeat_interleave(best.indices.shape[1]).numpy(),
                    "item_id": best.indices.flatten().numpy(),
                    "score": best.values.flatten().double().numpy(),
                }
            )
        if "item_id" not in model_input or model_input["item_id"].isna().any():
            raise ValueError("give item_id for every row to score pairs, or params top_k > 0")
        items = torch.tensor(model_input["item_id"].to_numpy(), dtype=torch.long)
        logits = self.model(users, items, self.categories[items])
        return pd.DataFrame(
            {
                "user_id": users.numpy(),
                "item_id": items.numpy(),
                "score": torch.sigmoid(logits).double().numpy(),
            }
        )


def register_recommender(
    run_id: str,
    model: TwoTower,
    towers: Mapping[str, Any],
    item_categories: list[int],
    registered_model_name: str,
    input_example: pd.DataFrame,
    tags: Mapping[str, str],
) -> str:
    """Log the recommender pyfunc to the run, register it, tag the version; return the version.

    Args:
        model: The trained towers.
        towers: The `TwoTower` constructor's arguments (the config's tower settings).
        item_categories: Category of every item id.
        input_example: A few (user_id, item_id) pairs from the test split.
    """
    with tempfile.TemporaryDirectory() as tmp:
        weights, spec = Path(tmp) / "model.pt", Path(tmp) / "spec.json"
        torch.save(model.state_dict(), weights)
        spec.write_text(json.dumps({"towers": dict(towers), "item_categories": item_categories}))
        mlflow.set_tracking_uri(tracking.tracking_uri())
        # Versions are numbered by the store: pipelines finishing together register one at a time.
        with tracking.store_lock(), mlflow.start_run(run_id=run_id):
            info = mlflow.pyfunc.log_model(
                name="model",
                python_model=TwoTowerRecommender(),
                artifacts={"weights": str(weights), "spec": str(spec)},
                signature=SIGNATURE,
                input_example=input_example,
                pip_requirements=tracking.pinned_requirements(
                    "torch", "numpy", "pandas", "cloudpickle"
                ),
            )
            version = tracking.new_model_version(info.model_uri, registered_model_name, run_id)
    client = tracking.store_client()
    for key, value in tags.items():
        client.set_model_version_tag(registered_model_name, version, key, value)
    return version
