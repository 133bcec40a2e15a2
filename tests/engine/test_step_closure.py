"""step(closure): the wrapped optimizer reads the average of the gradients the closure's
backward makes, on every rank alike; an optimizer that evaluates the closure again in one step
(LBFGS) is a clear error on every rank, where Horovod's zero_grad() raises."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ringtrain as rt
from ringtrain.testing import spawn

SIZES = [2, 3]


@pytest.fixture(params=SIZES, ids=[f"np{n}" for n in SIZES])
def world(request: pytest.FixtureRequest) -> spawn.World:
    return spawn.world(request.param)


def _closure_steps(case: str) -> dict[str, Any]:
    """A weight w = 1 whose gradient on rank r is r + 1; three SGD steps of lr 0.1 through
    step(closure), the closure zeroing, computing and back-propagating as torch's docs show."""
    r = rt.rank()
    w = torch.nn.Parameter(torch.tensor([1.0]))
    opt = rt.DistributedOptimizer(
        torch.optim.SGD([w], lr=0.1), named_parameters=[("w", w)], overlap=case == "overlap"
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (w * (r + 1)).sum()
        loss.backward()
        return loss

    losses = []
    for _ in range(3):
        if case == "backward-first":  # a backward before step(): synchronized first
            (w * 5.0).sum().backward()
            opt.synchronize()
            with opt.skip_synchronize():
                losses.append(float(opt.step(closure)))
        else:
            losses.append(float(opt.step(closure)))
    weights = rt.allgather_object(float(w))
    return {"weights": weights, "grad": float(w.grad), "losses": losses}


@pytest.mark.parametrize("case", ["plain", "overlap", "backward-first"])
def test_the_optimizer_reads_the_averaged_gradient_of_the_closure(
    world: spawn.World, case: str
) -> None:
    n = world.size
    avg = (n + 1) / 2
    for r, out in enumerate(world.run(_closure_steps, case)):
        assert out["weights"] == pytest.approx([1 - 0.3 * avg] * n), f"rank {r}: {out}"
        assert out["grad"] == pytest.approx(avg)
        # step() returns the closure's loss, this rank's own (as torch's and Horovod's do).
        w = [1 - 0.1 * avg * k for k in range(3)]
        assert out["losses"] == pytest.approx([x * (r + 1) for x in w])


def _lbfgs(max_iter: int) -> tuple[str, list[float]]:
    r = rt.rank()
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = rt.DistributedOptimizer(
        torch.optim.LBFGS([w], lr=0.5, max_iter=max_iter), named_parameters=[("w", w)]
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = ((w - r) ** 2).sum()
        loss.backward()
        return loss

    try:
        opt.step(closure)
        outcome = "ok"
    except AssertionError as e:  # Horovod's type for this (its zero_grad()'s assertion)
        outcome = f"{type(e).__name__}: {e}"
    return outcome, rt.allgather_object(w.detach().tolist())


def test_an_optimizer_that_evaluates_the_closure_twice_is_refused_on_every_rank(
    world2: spawn.World,
) -> None:
    for outcome, _ in world2.run(_lbfgs, 3):
        assert outcome.startswith("StepOrderError: LBFGS evaluated step()'s closure a second")
        assert "HINT:" in outcome
    # One evaluation per step (max_iter=1): the averaged gradient, the same weights everywhere.
    for outcome, weights in world2.run(_lbfgs, 1):
        assert outcome == "ok"
        assert weights[0] == weights[1] != [1.0, -2.0]
