"""What the checkpoint tests of local updates share: a small net with a per-rank buffer, and
training on each rank's own batches."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import ringtrain as rt


class Net(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 3)
        self.register_buffer("seen", torch.zeros(2))  # per rank: not exchanged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def train(model: Net, opt: Any, steps: range) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(1000 * s + rt.rank())  # each rank its own data
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        model.seen += rt.rank() + 1
