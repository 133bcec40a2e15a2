"""step() updates each bucket's parameters as soon as its reduction is done, while later buckets
are still on the wire: the same computation as one optimizer.step(), so the weights must be
bitwise equal to the whole-optimizer step (forced here with a step hook, which must run once per
step and so turns the bucket updates off). Also: which steps take the bucket path and which
fall back (the learning step, a closure, step hooks, sparse_as_dense, compression="auto")."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.engine.steps import whole as engine_whole
from ringtrain.testing.spawn import World

pytestmark = pytest.mark.timeout(600)

# Several buckets, the same plan in both runs (the link class pinned, as a comparison needs).
ENGINE = {"fusion_threshold_bytes": 4096, "link_class": "slow"}


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(32, 16),
        torch.nn.Linear(16, 48),
        torch.nn.GELU(),
        torch.nn.Linear(48, 16),
        torch.nn.Linear(16, 32),
    )


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if kind == "adam":  # two groups, one with its own learning rate
        return torch.optim.Adam([{"params": params[:2], "lr": 3e-3}, {"params": params[2:]}])
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)


def _train(kind: str, case: str, whole: bool, steps: int = 5) -> tuple[list[torch.Tensor], int]:
    """Weights after ``steps`` steps, and how many bucket updates ran."""
    model = _net()
    inner = _optimizer(kind, model)
    calls = []
    if whole:  # a step hook must run once per step: the engine steps the optimizer whole
        inner.register_step_post_hook(lambda *_: calls.append(1))
    opt = rt.DistributedOptimizer(
        inner,
        named_parameters=model.named_parameters(),
        compression="fp16" if case == "fp16" else "none",
        backward_passes_per_step=2 if case == "accumulate" else 1,
        **ENGINE,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    counted = []
    real = engine_whole.BucketUpdates.update

    def update(self: Any, s: int) -> None:
        counted.append(s)
        real(self, s)

    engine_whole.BucketUpdates.update = update  # type: ignore[method-assign]
    try:
        for step in range(steps):
            opt.zero_grad()
            for j in range(2 if case == "accumulate" else 1):
                g = torch.Generator().manual_seed(1000 * step + 10 * rt.rank() + j)
                tokens = torch.randint(0, 32, (4, 6), generator=g)
                out = model(tokens).flatten(0, 1)
                F.cross_entropy(out, torch.roll(tokens, 1, 1).flatten()).backward()
            opt.step()
            sched.step()
    finally:
        engine_whole.BucketUpdates.update = real  # type: ignore[method-assign]
    if whole:
        assert len(calls) == steps  # the hook ran once per step
    return [p.detach().clone() for p in model.parameters()], len(counted)


def _compare(kind: str, case: str) -> tuple[bool, int, int]:
    by_bucket, updates = _train(kind, case, whole=False)
    whole, none = _train(kind, case, whole=True)
    return all(torch.equal(a, b) for a, b in zip(by_bucket, whole)), updates, none


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("case", ["plain", "fp16", "accumulate"])
def test_bucket_updates_give_the_whole_steps_bits(world2: World, kind: str, case: str) -> None:
    for same, updates, none in world2.run(_compare, kind, case, timeout=300):
        assert same
        assert updates >= 2 * 4  # several buckets, every step but the learning one
        assert none == 0


def _falls_back() -> dict[str, bool]:
    model = _net()
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        **ENGINE,
    )

    def loss() -> torch.Tensor:
        return model(torch.arange(6).reshape(2, 3)).square().mean()

    out = {}
    loss().backward()
    out["learning step"] = opt._path.bucket_updates(None) is None
    opt.step()
    opt.zero_grad()
    loss().backward()
    out["closure"] = opt._path.bucket_updates(lambda: 0.0) is None
    out["plain"] = opt._path.bucket_updates(None) is not None
    opt.step()
    lbfgs = rt.DistributedOptimizer(
        torch.optim.LBFGS(model.parameters()), named_parameters=model.named_parameters(), **ENGINE
    )
    out["not per parameter"] = lbfgs._path.bucket_updates(None) is None
    # Past the learning step (where "plain" took the bucket path), these step whole. Each on
    # a model of its own: the optimizers above still hook this one's gradients.
    for name, setting in (
        ("sparse_as_dense", {"sparse_as_dense": True}),
        ("compression auto", {"compression": "auto"}),
    ):
        net = _net()
        other = rt.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1),
            named_parameters=net.named_parameters(),
            **setting,
            **ENGINE,
        )
        for step in range(2):
            other.zero_grad()
            net(torch.arange(6).reshape(2, 3)).square().mean().backward()
            if step == 1:
                out[name] = other._path.bucket_updates(None) is None
            other.step()
    return out


def test_what_takes_the_bucket_path(world2: World) -> None:
    for got in world2.run(_falls_back, timeout=300):
        assert all(got.values()), [name for name, ok in got.items() if not ok]


class _KeepsStep(torch.optim.SGD):
    pass


class _OwnStep(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:  # e.g. something across all parameters
        return super().step(closure)


def test_only_per_parameter_steps_take_the_bucket_path() -> None:
    from ringtrain.engine.overlap import steps_alike_by_bucket

    p = [torch.nn.Parameter(torch.zeros(2))]
    assert steps_alike_by_bucket(torch.optim.Adam(p))
    assert steps_alike_by_bucket(_KeepsStep(p, lr=0.1))
    assert not steps_alike_by_bucket(_OwnStep(p, lr=0.1))
    assert not steps_alike_by_bucket(torch.optim.LBFGS(p))
    hooked = torch.optim.SGD(p, lr=0.1)
    handle = hooked.register_step_pre_hook(lambda *_: None)
    assert not steps_alike_by_bucket(hooked)
    handle.remove()
    assert steps_alike_by_bucket(hooked)
    sched_on_inner = torch.optim.SGD(p, lr=0.1)
    torch.optim.lr_scheduler.StepLR(sched_on_inner, 2)  # patches the instance's step
    assert not steps_alike_by_bucket(sched_on_inner)
