"""The simple MLP of the DDP example: 10 -> 64 -> 64 -> 1."""

from torch import Tensor, nn


class SimpleMLP(nn.Module):
    def __init__(self, num_features: int = 10, hidden_size: int = 64, num_outputs: int = 1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(num_features, hidden_size),
            nn.ReLU(),
            nn.Linear(hidden_size, hidden_size),
            nn.ReLU(),
            nn.Linear(hidden_size, num_outputs),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)
