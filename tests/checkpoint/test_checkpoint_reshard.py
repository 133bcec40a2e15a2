"""Saved at 4 ranks (sharded), loaded at 1, 2, 3 and 6: the same model, optimizer state and data
position; resumed at 4: bitwise the weights of the run that never stopped.

Every rank writes its own part (its ZeRO-1 shard of the optimizer state, its share of the
model's tensors); loading hands the full state to an optimizer that re-splits it for its world.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
import ringtrain.checkpoint as ckpt
from ringtrain.elastic import ElasticSampler
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(900)
SMALL = {"fusion_threshold_bytes": 2048, "link_class": "fast"}
DATA = 48  # samples in the epoch
BATCH = 2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.a = torch.nn.Linear(6, 24)
        self.b = torch.nn.Linear(24, 24)
        self.c = torch.nn.Linear(24, 3)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _make(sharded: bool) -> tuple[Net, Any]:
    model = Net()
    groups: list[dict[str, Any]] = [
        {"params": [*model.a.parameters(), *model.c.parameters()]},
        {"params": list(model.b.parameters()), "lr": 0.02},
    ]
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(groups, lr=0.01),
        named_parameters=model.named_parameters(),
        shard_optimizer=sharded,
        **SMALL,
    )
    return model, opt


def _batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(1, 6, generator=g), torch.randint(0, 3, (1,), generator=g)


def _train(model: Net, opt: Any, sampler: ElasticSampler, batches: Iterator[int]) -> list[int]:
    """Train on the given batches of this rank's share; returns the sample indices used."""
    indices = list(sampler)
    used: list[int] = []
    for b in batches:
        opt.zero_grad()
        mine = indices[b * BATCH : (b + 1) * BATCH]
        loss = sum(F.cross_entropy(model(x), y) for x, y in map(_batch, mine))
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        model.seen += 1
        sampler.record_indices(mine)
        used += mine
    return used


def _full(model: Net, opt: Any) -> dict[str, Any]:
    """Everything to compare, as plain tensors (state_dict() gathers a sharded state)."""
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _save_at(path: str, steps: int) -> dict[str, Any] | None:
    model, opt = _make(sharded=True)
    sampler = ElasticSampler(list(range(DATA)), shuffle=True, seed=3)
    _train(model, opt, sampler, iter(range(steps)))
    torch.manual_seed(100 + rt.rank())  # a per-rank RNG state to come back
    ckpt.save(path, model=model, optimizer=opt, sampler=sampler, extra={"epoch": 0}, step=steps)
    full = _full(model, opt)
    return {
        "full": full,
        "rng": torch.get_rng_state(),
        "processed": sorted(sampler.processed_indices),
    }


def _load_at(path: str, sharded: bool) -> dict[str, Any]:
    model, opt = _make(sharded)
    sampler = ElasticSampler(list(range(DATA)), shuffle=True, seed=3)
    restored = ckpt.load(path, model=model, optimizer=opt, sampler=sampler)
    return {
        "full": _full(model, opt),
        "rng": torch.get_rng_state(),
        "indices": list(sampler),
        "step": restored.step,
        "extra": restored.extra,
        "saved": restored.saved_world_size,
    }


def _equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[Any]]]:
    path = str(tmp_path_factory.mktemp("ckpt") / "step-3")
    results = spawn.world(4).run(_save_at, path, 3, timeout=300)
    yield path, results
    spawn.close(6)  # only this module uses a world of 6: free its processes


@pytest.mark.parametrize("size", [1, 2, 3, 6])
@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "whole"])
def test_load_at_any_world_size(saved: tuple[str, list[Any]], size: int, sharded: bool) -> None:
    path, before = saved
    assert sorted(os.listdir(path)) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
        "__3_0.distcp",
        "manifest.json",
    ]
    after = spawn.world(size).run(_load_at, path, sharded, timeout=300)
    reference = before[0]["full"]
    remaining = set(range(DATA)) - set().union(*(set(b["processed"]) for b in before))
    dealt: list[int] = []
    for r, got in enumerate(after):
        _equal(reference, got["full"], f"rank {r}")
        assert got["step"] == 3 and got["extra"] == {"epoch": 0} and got["saved"] == 4
        assert torch.equal(got["rng"], before[r % 4]["rng"])
        dealt += got["indices"]
    # Each remaining sample once; fewer than `size` repeated as padding.
    assert set(dealt) == remaining
    assert len(dealt) - len(remaining) < size


def _uninterrupted(steps: int) -> list[torch.Tensor]:
    model, opt = _make(sharded=True)
    sampler = ElasticSampler(list(range(DATA)), shuffle=True, seed=3)
    _train(model, opt, sampler, iter(range(steps)))
    return [p.detach().clone() for p in model.parameters()]


def _resumed(path: str, first: int, steps: int) -> tuple[list[torch.Tensor], list[int], list[int]]:
    model, opt = _make(sharded=True)
    sampler = ElasticSampler(list(range(DATA)), shuffle=True, seed=3)
    before = _train(model, opt, sampler, iter(range(first)))
    ckpt.save(path, model=model, optimizer=opt, sampler=sampler, step=first)
    del model, opt
    model, opt = _make(sharded=True)
    sampler = ElasticSampler(list(range(DATA)), shuffle=True, seed=3)
    ckpt.load(path, model=model, optimizer=opt, sampler=sampler)
    # The sampler now deals the remaining indices afresh: batches count from 0 again.
    after = _train(model, opt, sampler, iter(range(steps - first)))
    return [p.detach().clone() for p in model.parameters()], before, after


def test_resumed_at_4_gives_the_uninterrupted_weights(tmp_path: Any) -> None:
    world = spawn.world(4)
    want = world.run(_uninterrupted, 6, timeout=300)
    got = world.run(_resumed, str(tmp_path / "step-3"), 3, 6, timeout=300)
    for r in range(4):
        for a, b in zip(want[r], got[r][0]):
            assert torch.equal(a, b), f"rank {r}: resumed weights differ"
    # After the resume the 4 ranks use each sample the first 3 steps left exactly once (6
    # steps x 4 ranks x 2 samples is the whole epoch of 48).
    before = [i for _, b, _ in got for i in b]
    after = [i for _, _, a in got for i in a]
    assert len(set(before)) == len(before) == 24
    assert sorted(after) == sorted(set(range(DATA)) - set(before))
