"""What the local-update tests share: a tiny model, each rank's own batches, an optimizer."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

import ringtrain as rt

H = 3  # sync_every
# The helpers give outer_overlap=False unless a test asks otherwise: a bare sync_every=H whose
# outer settings are not given measures its link (engine/local_defaults), and a test world's tiny
# steps make loopback "slow", which would pick the overlapped int4 exchange these tests do not
# check. Given, the settings stand as set.


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 12)
        self.b = torch.nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _alike(w: torch.Tensor) -> bool:
    every = rt.allgather(w.reshape(1, -1))
    return torch.equal(every, every[:1].expand_as(every))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * i + rt.rank())
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _step(model: torch.nn.Module, opt: Any, i: int) -> None:
    x, y = _batch(i)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _adam_local(**settings: Any) -> tuple[torch.nn.Module, Any]:
    """Tiny from seed 0 and a local-update optimizer (Adam lr 0.01 inside, ``sync_every=H``)."""
    torch.manual_seed(0)
    model = Tiny()
    settings.setdefault("outer_overlap", False)  # in line unless asked: see the note at H
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        sync_every=H,
        **settings,
    )
    return model, opt


def _sgd_local(**settings: Any) -> tuple[torch.nn.Module, Any, Any]:
    """Tiny from seed 0, plain SGD inside (lr 0.1) whose ``after`` holds the weights after each
    inner step, outer SGD lr 1 without momentum, no compression: the arithmetic is exact but
    for float rounding. Returns (model, the inner optimizer, the DistributedOptimizer)."""

    class Recording(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            out = super().step(closure)
            self.after = _weights(model)
            return out

    torch.manual_seed(0)
    model = Tiny()
    settings.setdefault("outer_overlap", False)  # in line unless asked: see the note at H
    inner = Recording(model.parameters(), lr=0.1)
    opt = rt.DistributedOptimizer(
        inner,
        named_parameters=model.named_parameters(),
        sync_every=H,
        outer_compression="none",
        outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0),
        **settings,
    )
    return model, inner, opt


def delay_exchanges(local: Any, seconds: float) -> None:
    """Every outer exchange of ``local`` (a LocalUpdate) sleeps ``seconds`` before it sends,
    where it runs (the group's worker): one rank's slow link, or a late thread."""
    for frag in local.fragments:
        average = frag.codec.average

        def late(flat: torch.Tensor, average: Any = average) -> torch.Tensor:
            time.sleep(seconds)
            return average(flat)

        frag.codec.average = late
