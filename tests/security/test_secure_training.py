"""Secure and plain DistributedOptimizer training end with the same weights.

The parameters and optimizer state are broadcast, the gradients averaged by the engine's
buckets, and the metrics allreduced, all sealed in secure mode. Two ranks: identical weights
(a ring of two sums in the same order as Gloo); three ranks: float32 rounding only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.testing import spawn


def _train(steps: int) -> dict[str, torch.Tensor]:
    r = rt.rank()
    torch.manual_seed(100 + r)  # different initial weights: broadcast_parameters must fix that
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt = rt.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    rt.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + r)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        rt.allreduce(loss.detach(), name=f"loss.{step}")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("size", [2, 3])
def test_secure_training_matches_plain(size: int, key_file: str) -> None:
    world = spawn.world(size)
    plain = world.run(_train, 6, timeout=120)
    sealed = world.run(_train, 6, timeout=120, secure=True, key_file=key_file)
    for p, s in zip(plain, sealed):
        for name in p:
            if size == 2:
                assert torch.equal(p[name], s[name]), name
            else:
                torch.testing.assert_close(p[name], s[name], rtol=1e-5, atol=1e-6, msg=name)
    for other in sealed[1:]:  # and every rank holds the same model
        for name in other:
            assert torch.equal(other[name], sealed[0][name]), name
