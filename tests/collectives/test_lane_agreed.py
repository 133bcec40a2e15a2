"""Large lane slots from 3 ranks agree before their data moves (collectives/agreed.py): the same
bits as the negotiated path, no backup copy, and a lost slot that moves nothing."""

from __future__ import annotations

import time

import pytest
import torch

import ringtrain as rt
from ringtrain.collectives import agreed, lane
from ringtrain.collectives.ops import controller_of
from ringtrain.testing import spawn

TIMEOUT = 150
BIG = agreed.AGREE_ABOVE_BYTES // 4 + 1024  # float32 elements: just above the bound


@pytest.fixture
def world3() -> spawn.World:
    return spawn.world(3)


def _data(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BIG, generator=g) * 100


def _counters() -> tuple[int, int, int]:
    fast = controller_of(None)._lane
    if fast is None:  # the lane is off
        return 0, 0, 0
    return fast.slots_valid, fast.slots_invalid, fast.backup_bytes


def _in_place(steps: int, late_s: float, release_s: float) -> tuple[list[torch.Tensor], tuple]:
    """Repeated in-place allreduces of one name; the last rank is ``late_s`` late at the last."""
    saved, lane.RELEASE_S = lane.RELEASE_S, release_s
    try:
        r, out = rt.rank(), []
        for s in range(steps):
            if s == steps - 1 and r == rt.size() - 1:
                time.sleep(late_s)
            t = _data(s, r)
            assert rt.allreduce_(t, name="big", op=rt.Sum) is t
            out.append(t)
        return out, _counters()
    finally:
        lane.RELEASE_S = saved


def test_large_slots_match_the_negotiated_path_bitwise_without_a_copy(world3: spawn.World) -> None:
    fast = world3.run(_in_place, 5, 0.0, 60.0, fast_lane=True, timeout=TIMEOUT)
    slow = world3.run(_in_place, 5, 0.0, 60.0, fast_lane=False, timeout=TIMEOUT)
    for r in range(3):
        for a, b in zip(fast[r][0], slow[r][0]):
            assert torch.equal(a, b)
        valid, invalid, backup_bytes = fast[r][1]
        assert valid >= 3 and invalid == 0 and backup_bytes == 0, fast[r][1]


def test_a_lost_large_slot_moves_nothing(world3: spawn.World) -> None:
    # The last rank stays away past the release time: the others' claims are released, its
    # dummy agrees to nothing, and the op is negotiated from the tensors as submitted.
    fast = world3.run(_in_place, 5, 2.0, lane.RELEASE_S, fast_lane=True, timeout=TIMEOUT)
    slow = world3.run(_in_place, 5, 0.0, 60.0, fast_lane=False, timeout=TIMEOUT)
    for (out, (valid, invalid, backup_bytes)), (negotiated, _) in zip(fast, slow):
        assert invalid == 1 and valid >= 2 and backup_bytes == 0
        assert torch.equal(out[-1], negotiated[-1])


def _unwaited(real: bool) -> tuple[bool, bool | None, bool]:
    """An agreed slot on the lane's group that nobody waits on: the agreement's callback
    starts the data (when every claim is real) without a thread asking."""
    group = rt.global_process_set.communicator.optional_group("lane")
    r = rt.rank()
    data = torch.full((BIG,), float(r + 1))
    opts = torch.distributed.AllreduceOptions()
    opts.reduceOp = torch.distributed.ReduceOp(torch.distributed.ReduceOp.SUM)
    mine = real or r != 1
    work = agreed.AgreedWork(group, 3, mine, lambda: group.allreduce([data], opts), opts)
    deadline = time.monotonic() + 30
    while work.valid is None and time.monotonic() < deadline:
        time.sleep(0.01)  # not asking: only the callback can move it on
    started = work._data is not None
    work.wait()
    expected = 6.0 if real else float(r + 1)
    return started, work.valid, bool((data == expected).all())


@pytest.mark.parametrize("real", [True, False], ids=["all-real", "a-dummy"])
def test_the_agreement_starts_the_data_of_an_op_nobody_waits_on(
    world3: spawn.World, real: bool
) -> None:
    for r, (started, valid, right) in enumerate(world3.run(_unwaited, real, timeout=TIMEOUT)):
        assert valid is real and right
        assert started is real, (r, started)
