"""From 3 ranks a lane slot keeps the submitted tensor without copying it (2 ranks: one value): a slot above 1 MiB
agrees before its data moves (collectives/agreed.py), a rank-ordered sum lands aside unless the
rank knows every claim is real (ordered.OrderedWork). Either way: the negotiated path's bits, no
backup copy, and a lost slot that leaves the tensor as submitted."""

from __future__ import annotations

import time

import pytest
import torch

import ringtrain as rt
from ringtrain.collectives import agreed, lane
from ringtrain.collectives.ops import controller_of
from ringtrain.testing import spawn
from ringtrain.transport import group_ops

TIMEOUT = 150
BIG = agreed.AGREE_ABOVE_BYTES // 4 + 1024  # float32 elements: just above the bound
SIZES = {"rank-ordered": 4096, "agreed": BIG}  # 16 KiB: summed in rank order


@pytest.fixture
def world3() -> spawn.World:
    return spawn.world(3)


def _data(step: int, rank: int, n: int = BIG) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, generator=g) * 100


def _counters() -> tuple[int, int, int]:
    driver = controller_of(None)._fast
    if driver is None:  # the lane is off
        return 0, 0, 0
    fast = driver.lane
    return fast.slots_valid, fast.slots_invalid, fast.backup_bytes


def _in_place(
    steps: int, late_s: float, release_s: float, n: int
) -> tuple[list[torch.Tensor], tuple]:
    """Repeated in-place allreduces of one name; the last rank is ``late_s`` late at the last."""
    saved, lane.RELEASE_S = lane.RELEASE_S, release_s
    try:
        r, out = rt.rank(), []
        for s in range(steps):
            if s == steps - 1 and r == rt.size() - 1:
                time.sleep(late_s)
            t = _data(s, r, n)
            assert rt.allreduce_(t, name="big", op=rt.Sum) is t
            out.append(t)
        return out, _counters()
    finally:
        lane.RELEASE_S = saved


@pytest.mark.parametrize("n", SIZES.values(), ids=SIZES.keys())
def test_slots_match_the_negotiated_path_bitwise_without_a_copy(
    world3: spawn.World, n: int
) -> None:
    fast = world3.run(_in_place, 5, 0.0, 60.0, n, fast_lane=True, timeout=TIMEOUT)
    slow = world3.run(_in_place, 5, 0.0, 60.0, n, fast_lane=False, timeout=TIMEOUT)
    for r in range(3):
        for a, b in zip(fast[r][0], slow[r][0]):
            assert torch.equal(a, b)
        valid, invalid, backup_bytes = fast[r][1]
        assert valid >= 3 and invalid == 0 and backup_bytes == 0, fast[r][1]


@pytest.mark.parametrize("n", SIZES.values(), ids=SIZES.keys())
def test_a_lost_slot_leaves_the_tensor_as_submitted(world3: spawn.World, n: int) -> None:
    # The last rank stays away past the release time: the others' claims are released, its
    # dummy marks the slot (agrees to nothing, or NaN in every chunk: the sum lands aside),
    # and the op is negotiated from the tensors as submitted.
    fast = world3.run(_in_place, 5, 2.0, lane.RELEASE_S, n, fast_lane=True, timeout=TIMEOUT)
    slow = world3.run(_in_place, 5, 0.0, 60.0, n, fast_lane=False, timeout=TIMEOUT)
    for (out, (valid, invalid, backup_bytes)), (negotiated, _) in zip(fast, slow):
        assert invalid == 1 and valid >= 2 and backup_bytes == 0
        assert torch.equal(out[-1], negotiated[-1])


def _unwaited(real: bool) -> tuple[bool, bool | None, bool]:
    """An agreed slot on the lane's group that nobody waits on: the agreement's callback
    starts the data (when every claim is real) without a thread asking."""
    group = rt.global_process_set.communicator.optional_group("lane")
    r = rt.rank()
    data = torch.full((BIG,), float(r + 1))
    total = group_ops.PreparedSum(group)
    mine = real or r != 1
    work = agreed.AgreedWork(3, mine, lambda: total(data), total)
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


def test_gloo_s_ring_up_to_1_mib_still_copies(world3: spawn.World) -> None:
    # reproducible=False: a small slot sums on Gloo's ring, which leaves partial sums in the
    # tensor; the claim copies it into the lane's backup buffer (what the other paths avoid).
    n = SIZES["rank-ordered"]
    fast = world3.run(
        _in_place, 4, 0.0, 60.0, n, fast_lane=True, reproducible=False, timeout=TIMEOUT
    )
    for _, (valid, invalid, backup_bytes) in fast:
        assert valid >= 2 and invalid == 0 and backup_bytes == valid * n * 4


def test_a_lost_in_place_slot_at_2_ranks_gives_the_tensor_back(world2: spawn.World) -> None:
    # Two ranks change only the first value (the dummy's NaN), restored from a one-value copy:
    # the dummy must mark nothing else, or a lost slot would leave NaN in the tensor.
    n = SIZES["rank-ordered"]
    fast = world2.run(_in_place, 5, 2.0, lane.RELEASE_S, n, fast_lane=True, timeout=TIMEOUT)
    slow = world2.run(_in_place, 5, 0.0, 60.0, n, fast_lane=False, timeout=TIMEOUT)
    for (out, (valid, invalid, _)), (negotiated, _) in zip(fast, slow):
        assert invalid == 1 and valid >= 2
        assert torch.equal(out[-1], negotiated[-1])
