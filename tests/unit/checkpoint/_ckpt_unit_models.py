"""Tiny deterministic model and training loop shared by the checkpoint unit tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


class TinyNet(nn.Module):
    """Two linears and a buffer: parameters, a persistent buffer and a ReLU in between."""

    def __init__(self, hidden: int = 6) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.fc2 = nn.Linear(hidden, 2)
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


@dataclass
class Trainer:
    """A deterministic Adam training loop: batch ``i`` depends only on ``i``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)

    def step(self, i: int) -> float:
        x, y = self.batch(i)
        self.optimizer.zero_grad()
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.item())
        return self.losses[-1]


def make_trainer(seed: int, hidden: int = 6, lr: float = 0.02, weight_decay: float = 0.1) -> Trainer:
    """A fresh model + never-stepped AdamW; different seeds give different initial weights."""
    torch.manual_seed(seed)
    model = TinyNet(hidden)
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay))
