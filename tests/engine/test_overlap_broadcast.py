"""``broadcast_parameters`` right after an overlapped ``step()`` (``overlap=True``), without
``synchronize()`` first: the step's update is still pending on the updater thread.

Horovod's ``step()`` returns with the parameters updated, so a broadcast after it sends and
overwrites final values. Here the broadcast waits for the pending updates first; before, the
root could send its weights before its update and a peer's update could land before or after the
broadcast overwrote them: the ranks ended with different weights, silently, even after a
``synchronize()``. Shown with rank 0's last update delayed (its waits sleep first).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.testing.spawn import World

pytestmark = pytest.mark.timeout(300)


def _delay_updates(opt: Any) -> None:
    """This rank's updater waits 0.3 s before each bucket of the next step."""
    exchange = opt._path.planner.exchange  # learned at the first step
    assert exchange is not None
    real = exchange.finish_slot

    def late(s: int, **kw: Any) -> None:
        time.sleep(0.3)
        real(s, **kw)

    exchange.finish_slot = late


def _broadcast_after_step(named: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        overlap=True,
        fusion_threshold_bytes=1024,
    )
    rt.broadcast_parameters(model.state_dict(), 0)
    for step in range(4):
        if step == 3 and rt.rank() == 0:
            _delay_updates(opt)
        g = torch.Generator().manual_seed(10 * step + rt.rank())
        opt.zero_grad()
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        F.mse_loss(model(x), y).backward()
        opt.step()
    assert opt.overlap
    params = list(model.named_parameters()) if named else list(model.parameters())
    rt.broadcast_parameters(params, 0)
    opt.synchronize()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("named", [True, False])
def test_a_broadcast_after_an_overlapped_step_leaves_every_rank_alike(
    world2: World, named: bool
) -> None:
    every = world2.run(_broadcast_after_step, named, timeout=120)
    for mine in every[1:]:
        assert all(torch.equal(a, b) for a, b in zip(mine, every[0]))
