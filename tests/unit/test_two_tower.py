"""The two-tower model, its loss and metrics, and the config's checks (cheap, no ranks)."""

import pytest
import torch

from trainflow.configs.two_tower import TwoTowerConfig, load_two_tower_preset
from trainflow.models.two_tower import TwoTower, recall_at_k, sampled_negative_loss


def _towers() -> TwoTower:
    torch.manual_seed(0)
    return TwoTower(10, 6, 2, 4, [8], 4)


def test_score_all_agrees_with_pairwise_logits():
    model, categories = _towers(), torch.tensor([0, 1, 0, 1, 0, 1])
    users = torch.tensor([2, 7])
    every = model.score_all(users, categories)
    items = torch.arange(6)
    for row, user in enumerate(users):
        pairs = model(user.repeat(6), items, categories)
        torch.testing.assert_close(every[row], pairs.detach())


def test_loss_falls_on_a_learnable_preference():
    model, categories = _towers(), torch.tensor([0, 1, 0, 1, 0, 1])
    users, items = torch.arange(10).repeat(6), torch.arange(6).repeat_interleave(10)
    labels = ((users % 2) == (items % 2)).float()  # even users click even items
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(60):
        loss = sampled_negative_loss(model, users, items, labels, categories, 1, generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_recall_at_k_counts_relevant_items_in_the_top_k():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.0], [0.0, 0.1, 0.2, 0.3]])
    assert recall_at_k(scores, [{0, 2}, {3}], k=2) == pytest.approx((0.5 + 1.0) / 2)
    assert recall_at_k(scores, [set(), {0}], k=2) == 0.0  # users without clicks are left out


def test_default_is_the_debug_cpu_preset_and_data_splits_by_time():
    config = load_two_tower_preset("debug_cpu")
    assert config.training_fields() == TwoTowerConfig().training_fields()
    data = config.data_config()
    assert data.test.order_column == data.validation.order_column == "id"
    assert (data.test.name, data.validation.name) == ("test", "validation")


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"towers": {"num_users": 0}}, "num_users"),
        ({"data": {"user_column": "clicked"}}, "one role"),
        ({"data": {"dataset": "nope.txt"}}, "data.dataset"),
        ({"data": {"test_fraction": 0.0}}, "test_fraction"),
    ],
)
def test_bad_config_names_the_field(update, field):
    with pytest.raises(ValueError, match=field):
        TwoTowerConfig.model_validate(update)
