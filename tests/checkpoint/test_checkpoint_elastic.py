"""``hvd.elastic.TorchState`` saves to disk and loads through ringtrain.checkpoint, at any size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ringtrain as rt
import ringtrain.torch as hvd
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(600)


def _state(seed: int) -> Any:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sampler = hvd.elastic.ElasticSampler(list(range(20)), seed=1)
    state = hvd.elastic.TorchState(
        model=model, optimizer=opt, sampler=sampler, scheduler=sched, epoch=0, batch=0
    )
    return state


def _save(path: str) -> dict[str, Any]:
    state = _state(1)
    for b in range(2):
        state.optimizer.zero_grad()
        state.model(torch.ones(2, 4) * (b + 1)).sum().backward()
        state.optimizer.step()
        state.scheduler.step()
        state.sampler.record_batch(b, 2)
        state.batch = b + 1
    state.epoch = 4
    state.commit()
    state.save_checkpoint(path, step=2)
    return {
        "weight": state.model.weight.detach().clone(),
        "lr": state.optimizer.param_groups[0]["lr"],
        "processed": sorted(state.sampler.processed_indices),
    }


def _load(path: str) -> dict[str, Any]:
    state = _state(2)
    restored = state.load_checkpoint(path)
    state.restore()  # back to the commit load_checkpoint made: the loaded values
    return {
        "weight": state.model.weight.detach().clone(),
        "lr": state.optimizer.param_groups[0]["lr"],
        "sched_epoch": state.scheduler.last_epoch,
        "epoch": state.epoch,
        "batch": state.batch,
        "indices": list(state.sampler),
        "step": restored.step,
        "rank": rt.rank(),
    }


def test_torch_state_saves_and_loads_at_another_size(tmp_path: Path) -> None:
    path = str(tmp_path / "step-2")
    before = spawn.world(2).run(_save, path)
    after = spawn.world(3).run(_load, path)
    done = set(before[0]["processed"]) | set(before[1]["processed"])
    dealt: list[int] = []
    for got in after:
        assert torch.equal(got["weight"], before[0]["weight"])
        assert got["lr"] == before[0]["lr"] == 0.025
        assert got["sched_epoch"] == 2
        assert (got["epoch"], got["batch"], got["step"]) == (4, 2, 2)
        dealt += got["indices"]
    assert set(dealt) == set(range(20)) - done
    assert len(dealt) - (20 - len(done)) < 3
