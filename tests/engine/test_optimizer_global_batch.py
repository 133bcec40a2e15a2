"""DistributedOptimizer on N ranks equals one process training on the global batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.testing.spawn import World

STEPS = 10
PER_RANK = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(PER_RANK * n, 6, generator=g), torch.randint(
        0, 3, (PER_RANK * n,), generator=g
    )


def _train(opt_name: str) -> list[torch.Tensor]:
    r, n = rt.rank(), rt.size()
    model = _model()
    base = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if opt_name == "sgd"
        else torch.optim.Adam(model.parameters(), lr=0.01)
    )
    opt = rt.DistributedOptimizer(base, named_parameters=model.named_parameters())
    for step in range(STEPS):
        x, y = _data(step, n)
        mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
        opt.zero_grad()
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _reference(opt_name: str, n: int) -> list[torch.Tensor]:
    model = _model()
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if opt_name == "sgd"
        else torch.optim.Adam(model.parameters(), lr=0.01)
    )
    for step in range(STEPS):
        x, y = _data(step, n)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()  # mean over the global batch
        opt.step()
    return [p.detach() for p in model.parameters()]


def _same_weights_as_global_batch(world: World) -> None:
    for opt_name in ("sgd", "adam"):
        expected = _reference(opt_name, world.size)
        for weights in world.run(_train, opt_name):
            for got, want in zip(weights, expected):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_same_weights_as_global_batch(world: World) -> None:
    _same_weights_as_global_batch(world)


def test_same_weights_as_global_batch_under_every_cpu_capability(
    capability_world2: World,
) -> None:
    """The same, with the ranks on each CPU capability's kernels (this process's reference on
    its own): the tolerance is for summation order, whichever kernels sum."""
    _same_weights_as_global_batch(capability_world2)


def _broadcast_state() -> None:
    r = rt.rank()
    torch.manual_seed(r)  # different initial weights on every rank
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1 * (r + 1))
    if r == 0:  # only the root has optimizer state
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    rt.broadcast_optimizer_state(opt, root_rank=0)
    w = rt.allgather(model.weight.detach().reshape(1, -1))
    assert torch.equal(w, w[:1].expand_as(w)), "parameters differ after broadcast"
    assert opt.param_groups[0]["lr"] == 0.1
    avg = opt.state[model.weight]["exp_avg"]
    gathered = rt.allgather(avg.reshape(1, -1))
    assert torch.equal(gathered, gathered[:1].expand_as(gathered)), (
        "optimizer state differs after broadcast"
    )


def test_broadcast_parameters_and_optimizer_state(world: World) -> None:
    world.run(_broadcast_state)


def _zero_grad_guard() -> str:
    model = torch.nn.Linear(2, 1)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model(torch.ones(1, 2)).sum().backward()
    try:
        opt.zero_grad()
    except rt.CollectiveArgumentError as e:
        opt.synchronize()
        return str(e)
    return "" if rt.size() == 1 else "no error"


def test_zero_grad_before_step_is_explained(world2: World) -> None:
    for msg in world2.run(_zero_grad_guard):
        assert "before optimizer.step()" in msg


def _scheduler_accepts_wrapper() -> float:
    model = torch.nn.Linear(2, 1)
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    sched.step()
    return float(opt.param_groups[0]["lr"])


def test_lr_scheduler_works_with_wrapper(world2: World) -> None:
    assert world2.run(_scheduler_accepts_wrapper) == [0.5, 0.5]
