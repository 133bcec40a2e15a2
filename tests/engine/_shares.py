"""A tiny task split by batch shares, shared by the batch_shares tests (synchronous and local
updates): every rank's samples of a step are its slice of one global batch."""

from __future__ import annotations

import torch

SHARES = (3, 1)  # samples per unit: rank 0 takes 6 of every 8, rank 1 takes 2
UNIT = 2


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``."""
    n = sum(SHARES) * UNIT
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def mine(r: int) -> slice:
    """Rank ``r``'s slice of a global batch."""
    start = sum(SHARES[:r]) * UNIT
    return slice(start, start + SHARES[r] * UNIT)
