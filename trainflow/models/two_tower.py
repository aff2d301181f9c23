"""A two-tower recommender: a user tower and an item tower meet in a dot product.

Each tower embeds ids (the item tower adds its category) and passes them through an MLP; the
logit of a (user, item) pair is the dot product of the two output vectors. Item vectors do not
depend on the user, so ranking every item for a user is one matrix product.
"""

import torch
from torch import Tensor, nn


def _mlp(in_dim: int, hidden_sizes: list[int], out_dim: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in hidden_sizes:
        layers += [nn.Linear(in_dim, width), nn.ReLU()]
        in_dim = width
    layers.append(nn.Linear(in_dim, out_dim))
    return nn.Sequential(*layers)


class TwoTower(nn.Module):
    """User and item towers; `forward(users, items, categories)` gives one logit per pair."""

    def __init__(
        self,
        num_users: int,
        num_items: int,
        num_categories: int,
        embedding_dim: int,
        hidden_sizes: list[int],
        output_dim: int,
    ) -> None:
        super().__init__()
        self.user_embedding = nn.Embedding(num_users, embedding_dim)
        self.item_embedding = nn.Embedding(num_items, embedding_dim)
        self.category_embedding = nn.Embedding(num_categories, embedding_dim)
        self.user_tower = _mlp(embedding_dim, hidden_sizes, output_dim)
        self.item_tower = _mlp(2 * embedding_dim, hidden_sizes, output_dim)

    def user_vectors(self, users: Tensor) -> Tensor:
        return self.user_tower(self.user_embedding(users))

    def item_vectors(self, items: Tensor, categories: Tensor) -> Tensor:
        features = torch.cat([self.item_embedding(items), self.category_embedding(categories)], -1)
        return self.item_tower(features)

    def forward(self, users: Tensor, items: Tensor, categories: Tensor) -> Tensor:
        """Logits of the pairs `(users[i], items[i])`, shape `(n,)`."""
        return (self.user_vectors(users) * self.item_vectors(items, categories)).sum(-1)

    @torch.no_grad()
    def score_all(self, users: Tensor, item_categories: Tensor) -> Tensor:
        """Logits of every item for each user, shape `(len(users), num_items)`.

        Args:
            users: User ids.
            item_categories: The category of each item id, shape `(num_items,)`.
        """
        items = torch.arange(len(item_categories), device=item_categories.device)
        return self.user_vectors(users) @ self.item_vectors(items, item_categories).T


def sampled_negative_loss(
    model: nn.Module,
    users: Tensor,
    items: Tensor,
    labels: Tensor,
    item_categories: Tensor,
    num_negatives: int,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Binary cross-entropy on the observed pairs plus sampled negatives.

    Every clicked pair also gets `num_negatives` items drawn uniformly as label-0 pairs for its
    user. Items are drawn uniformly in the data as well, so the loss is lowest when a pair's
    logit grows with its click probability: the ranking the towers learn is the one that
    matters.

    Args:
        model: Called as `model(users, items, categories)` (the towers, maybe wrapped).
        users, items, labels: One batch of observed interactions (labels 0/1).
        item_categories: Category of each item id (negatives need theirs).
        num_negatives: Items drawn per clicked pair.
        generator: Random source of the negatives (seeded per rank for a reproducible run).
    """
    positives = labels > 0.5
    neg_users = users[positives].repeat_interleave(num_negatives)
    neg_items = torch.randint(
        len(item_categories),
        (len(neg_users),),
        generator=generator,
        device=generator.device if generator is not None else users.device,
    ).to(users.device)
    all_users = torch.cat([users, neg_users])
    all_items = torch.cat([items, neg_items])
    all_labels = torch.cat([labels, torch.zeros_like(neg_users, dtype=labels.dtype)])
    logits = model(all_users, all_items, item_categories[all_items])
    return nn.functional.binary_cross_entropy_with_logits(logits, all_labels)


def recall_at_k(scores: Tensor, relevant: list[set[int]], k: int) -> float:
    """Mean over users of the share of their relevant items among their `k` best-scored.

    Args:
        scores: `(num_users, num_items)` scores, one row per user.
        relevant: Each row's relevant items; users with none are left out of the mean.
        k: How many items each user is shown.
    """
    top = torch.topk(scores, min(k, scores.shape[1]), dim=1).indices.tolist()
    recalls = [
        len(want & set(got)) / len(want) for got, want in zip(top, relevant, strict=True) if want
    ]
    return sum(recalls) / len(recalls) if recalls else float("nan")
