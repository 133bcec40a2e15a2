"""Local updates with batch_shares: the outer average weighs each rank by the samples it took.

Two ranks at shares [3, 1] take equal inner steps on 6 and 2 samples of each global batch; after
a few rounds the anchor equals that of one process that runs both ranks' inner steps and steps
the outer optimizer with the share-weighted mean of their changes (issue 41 item 4)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.config import Config
from ringtrain.engine import settings
from ringtrain.engine.local_update import nesterov
from ringtrain.engine.settings import Reduction
from ringtrain.errors import ConfigError
from ringtrain.testing.spawn import World

H = 3  # sync_every
ROUNDS = 3
SHARES = (3, 1)  # samples per unit: rank 0 takes 6 of every 8, rank 1 takes 2
UNIT = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = sum(SHARES) * UNIT
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _mine(r: int) -> slice:
    start = sum(SHARES[:r]) * UNIT
    return slice(start, start + SHARES[r] * UNIT)


def _inner_step(model: torch.nn.Module, opt: Any, step: int, r: int) -> None:
    x, y = _data(step)
    opt.zero_grad()
    F.cross_entropy(model(x[_mine(r)]), y[_mine(r)]).backward()
    opt.step()


def _train(shares: list[int] | None) -> list[torch.Tensor]:
    """This rank's anchor after ROUNDS rounds (outer exchange in float32: an exact wire)."""
    model = _model()
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        sync_every=H,
        outer_compression="none",
        batch_shares=shares,
    )
    for step in range(H * ROUNDS):
        _inner_step(model, opt, step, rt.rank())
    local = opt.local_update
    assert local is not None and local.inner_steps == 0 and local.anchor is not None
    return [a.clone() for a in local.anchor]


def _runs() -> dict[str, list[torch.Tensor]]:
    return {
        "shares": _train(list(SHARES)),
        "again": _train(list(SHARES)),
        "equal": _train([2, 2]),
        "plain": _train(None),
    }


def _reference() -> list[torch.Tensor]:
    """Both ranks' inner steps in one process; each round the anchor takes the outer step
    (DiLoCo's Nesterov) with the share-weighted mean of the ranks' changes."""
    ranks = [_model() for _ in SHARES]
    inner = [torch.optim.Adam(m.parameters(), lr=0.01) for m in ranks]
    anchor = list(_model().parameters())
    outer = nesterov(anchor)
    weights = [s / sum(SHARES) for s in SHARES]
    for step in range(H * ROUNDS):
        for r, (m, opt) in enumerate(zip(ranks, inner)):
            _inner_step(m, opt, step, r)
        if (step + 1) % H == 0:
            with torch.no_grad():
                for i, a in enumerate(anchor):
                    own = [list(m.parameters())[i] for m in ranks]
                    a.grad = sum(w * (a - p) for w, p in zip(weights, own))  # type: ignore[assignment]
                outer.step()
                for m in ranks:
                    for p, a in zip(m.parameters(), anchor):
                        p.copy_(a)
    return [a.detach() for a in anchor]


def test_the_outer_average_weighs_ranks_by_share_and_repeats_bitwise(world2: World) -> None:
    expected = _reference()
    per_rank = world2.run(_runs)
    for runs in per_rank:
        for got, want in zip(runs["shares"], expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for a, b in zip(runs["shares"], runs["again"]):
            assert torch.equal(a, b), "two runs with the same shares differ"
        for a, b in zip(runs["equal"], runs["plain"]):
            assert torch.equal(a, b), "equal shares must keep the plain mean's bits"
        # The weighting is seen: the plain mean's anchor is elsewhere.
        assert any(not torch.allclose(a, b) for a, b in zip(runs["shares"], runs["plain"]))
    for a, b in zip(per_rank[0]["shares"], per_rank[1]["shares"]):
        assert torch.equal(a, b), "the ranks' anchors differ"


def test_measured_shares_are_refused_with_local_updates() -> None:
    config = Config.from_env({"RINGTRAIN_SYNC_EVERY": "10"})
    fixed = Reduction.of(None, 1.0, 1, False, [3, 1])
    assert settings.check(config, fixed).shares == (3.0, 1.0)
    with pytest.raises(ConfigError, match="give the shares"):
        settings.check(config, Reduction.of(None, 1.0, 1, False, "auto"))
