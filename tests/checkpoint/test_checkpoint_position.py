"""The data position of torch's DistributedSampler across world sizes, and compressor state:
restored at the same size, reset at another (auto keeps its decision)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

import ringtrain as rt
import ringtrain.checkpoint as ckpt
from ringtrain.checkpoint import samplers
from ringtrain.errors import ConfigError
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("new_size", [1, 2, 3, 5, 8])
def test_distributed_sampler_rest_of_epoch(shuffle: bool, drop_last: bool, new_size: int) -> None:
    data = list(range(37))  # does not divide by 4: padding (or dropping) as torch does it
    old = [
        DistributedSampler(
            data, num_replicas=4, rank=r, shuffle=shuffle, seed=9, drop_last=drop_last
        )
        for r in range(4)
    ]
    for s in old:
        s.set_epoch(2)
    consumed = 5
    seen = set()
    for s in old:
        seen.update(list(s)[:consumed])
    states = [samplers.save((s, consumed)) for s in old]
    every_index = set().union(*(set(s) for s in old))  # what this epoch deals at all
    fresh = DistributedSampler(data, num_replicas=new_size, rank=0, shuffle=shuffle, seed=9)
    dealt: list[int] = []
    for r in range(new_size):
        rest = samplers.restore(fresh, states, r, new_size)
        assert isinstance(rest, ckpt.Remaining) and rest.epoch == 2
        dealt += list(rest)
    assert fresh.epoch == 2
    assert set(dealt) == every_index - seen
    assert len(dealt) - len(every_index - seen) < new_size  # padding only


def test_distributed_sampler_position_is_a_count() -> None:
    """``consumed`` counts this rank's indices used (docs/checkpoint.md); a list of them is
    refused with what to pass, and numpy's integers count as integers."""
    sampler = DistributedSampler(list(range(10)), num_replicas=2, rank=0)
    with pytest.raises(ConfigError) as err:
        samplers.save((sampler, [0, 2, 4]))
    assert str(err.value) == (
        "a DistributedSampler does not know how far the epoch went (consumed was a list).\n"
        "HINT: pass sampler=(sampler, consumed), consumed being how many of this rank's "
        "indices were used this epoch, a number (batches done * batch size)."
    )
    assert samplers.save((sampler, np.int64(3)))["consumed"] == 3


def _save_distributed(path: str) -> list[int]:
    data = list(range(30))
    s = DistributedSampler(data, num_replicas=rt.size(), rank=rt.rank(), shuffle=True, seed=1)
    s.set_epoch(1)
    ckpt.save(path, sampler=(s, 4))
    return list(s)[:4]


def test_distributed_sampler_through_save_and_load(tmp_path: Path, world2: spawn.World) -> None:
    path = str(tmp_path / "step-1")
    used = world2.run(_save_distributed, path)
    s = DistributedSampler(list(range(30)), num_replicas=1, rank=0, shuffle=True, seed=1)
    restored = ckpt.load(path, sampler=s)
    assert sorted(restored.data) == sorted(set(range(30)) - set(used[0]) - set(used[1]))


def _compressed(path: str, compression: str) -> dict[str, Any]:
    torch.manual_seed(3)
    model = torch.nn.Linear(16, 8)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    return _train_and_save(path, model, opt)


def _load_compressed(path: str, compression: str) -> dict[str, Any]:
    model = torch.nn.Linear(16, 8)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    ckpt.load(path, model=model, optimizer=opt)
    return opt.compression.state_dict()


def test_topk_error_feedback_same_size_restored_other_size_reset(tmp_path: Path) -> None:
    path = str(tmp_path / "step-3")
    saved = spawn.world(2).run(_compressed, path, "topk")
    assert saved[0]["residuals"] and saved[1]["residuals"]
    again = spawn.world(2).run(_load_compressed, path, "topk")
    for r in range(2):  # each rank its own residuals
        for k, v in saved[r]["residuals"].items():
            assert torch.equal(again[r]["residuals"][k], v)
    at_three = spawn.world(3).run(_load_compressed, path, "topk")
    assert all(not got["residuals"] for got in at_three)


def _train_and_save(path: str, model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    """Three steps, each rank on its own data (so the compressors hold state), then a save:
    the compressor's state as saved."""
    for step in range(3):
        opt.zero_grad()
        model(torch.ones(2, 16) * (rt.rank() + step + 1)).sum().backward()
        opt.step()
    ckpt.save(path, model=model, optimizer=opt)
    state: dict[str, Any] = opt.compression.state_dict()
    return state


def _auto_on_topk(path: str) -> dict[str, Any]:
    """An ``auto`` optimizer whose decision is top-k (restored, as a resumed job's is: on
    loopback auto would keep uncompressed, which has no state), trained so top-k holds error
    feedback, then saved."""
    from ringtrain.engine.optimizer import COMPRESSOR_STATE_KEY

    torch.manual_seed(3)
    model = torch.nn.Linear(16, 8)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression="auto",
    )
    decided = {"version": 1, "choice": "topk", "reason": "decided before the save"}
    opt.load_state_dict(
        {**opt.state_dict(), COMPRESSOR_STATE_KEY: {"name": "auto", "state": decided}}
    )
    return _train_and_save(path, model, opt)


def test_auto_keeps_its_decision_at_another_size_with_its_inner_state_reset(
    tmp_path: Path, world2: spawn.World
) -> None:
    path = str(tmp_path / "step-3")
    saved = world2.run(_auto_on_topk, path)
    assert all(s["choice"] == "topk" and s["inner"]["residuals"] for s in saved)
    again = world2.run(_load_compressed, path, "auto")
    for r in range(2):  # same size: the decision and each rank's own residuals
        assert again[r]["choice"] == "topk"
        for k, v in saved[r]["inner"]["residuals"].items():
            assert torch.equal(again[r]["inner"]["residuals"][k], v)
    (alone,) = spawn.world(1).run(_load_compressed, path, "auto")
    assert alone["choice"] == "topk" and "restored from a checkpoint" in alone["reason"]
    assert not alone["inner"]["residuals"]  # error feedback of 2 ranks means nothing at 1
