"""A peer that leaves right after its last lane slot: this rank's op in that slot completes.

Rounds are messages built, then exchanged. A rank whose user thread claims a lane slot just
after its controller built a round's message sends "nothing in flight"; if the peer matched
that slot, finished its script and votes to shut down in the same round, the set ends at once
(nobody seems busy). The claimed op must still complete with the slot's result, not fail with
"rank 1 shut down before this collective completed": its peer did take part. Two ways the set
ends first: this rank has not yet seen its side of the slot complete (its Gloo thread was
descheduled), or its user thread took the slot's verdict (valid) and was descheduled before it
handed the op its result. Under load each happened about once in 30-300 runs of the lane's
mismatch test (the second in CI, stop 72); here hooks on the two controllers' control channels
make that round happen every time (the controllers' internals are reached on purpose: the
order of threads on two ranks is the thing under test).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ringtrain as rt
from ringtrain.collectives import lane
from ringtrain.collectives.control_round import Message
from ringtrain.collectives.ops import controller_of
from ringtrain.testing import spawn

TIMEOUT = 120
N = 4096  # 16 KiB of float32: rides the lane


@pytest.fixture(scope="module")
def world() -> spawn.World:
    return spawn.world(2)


def _data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(1000 * step + rank)) * 100


def _hook(ctl: Any, at: int, before: Callable[[Message], None]) -> None:
    """Run ``before(message)`` on the controller's thread just before its round number ``at``
    goes out (every rank counts rounds alike: each is one exchange among all of them)."""
    channel = ctl._channel
    real = channel.exchange

    def exchange(mine: Message) -> list[Message]:
        if channel.rounds == at:
            before(mine)
        return real(mine)

    channel.exchange = exchange


class _SeenLate:
    """A collective whose completion this rank sees ``lag_s`` late, as when its Gloo thread is
    descheduled on a loaded machine after the peer already has the result."""

    def __init__(self, work: Any, lag_s: float) -> None:
        self._work, self._at = work, time.monotonic() + lag_s

    def is_completed(self) -> bool:
        return time.monotonic() >= self._at and bool(self._work.is_completed())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        left = self._at - time.monotonic()
        if timeout is not None and left > timeout.total_seconds():
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Timed out waiting for the collective")  # as Gloo's timed wait
        time.sleep(max(left, 0.0))
        return bool(self._work.wait() if timeout is None else self._work.wait(timeout))


def _hand_over_after_the_end(ctl: Any, sent: threading.Event) -> None:
    """This rank takes its slot's verdict at once, but hands the op its result only once the
    set has ended (its thread descheduled in between); the stale round goes out meanwhile."""
    driver = ctl._fast
    finish = driver._finish

    def late(claim: lane.Claim) -> None:
        driver._finish = finish
        assert claim.valid, "the slot was not valid"
        sent.set()
        deadline = time.monotonic() + 30
        while not ctl._end.closed and time.monotonic() < deadline:
            time.sleep(0.005)
        finish(claim)

    driver._finish = late


def _last_slot_then_leave(hold_s: float, late: str) -> list[float] | None:
    saved, lane.RELEASE_S = lane.RELEASE_S, 60.0  # no slot released for a slow machine
    try:
        return _scenario(hold_s, late)
    finally:
        lane.RELEASE_S = saved


def _scenario(hold_s: float, late: str) -> list[float] | None:
    r = rt.rank()
    ctl = controller_of(None)
    for s in range(3):
        rt.allreduce(_data(s, r), name="m", op=rt.Sum)  # the lane opens for "m"
    assert ctl.lane_slots[0] >= 1
    # A round both ranks will reach: a few past the later of the two counts now.
    count = torch.tensor([ctl._channel.rounds], dtype=torch.int64)
    at = int(rt.allreduce(count, name="count", op=rt.Max)) + 3
    if r == 0:
        # Round ``at`` carries a message built while nothing was pending here; the user thread
        # claims the slot before it goes out, and waits a while before asking for the result.
        there, sent = threading.Event(), threading.Event()

        def stale(mine: Message) -> None:
            assert not mine.busy
            there.set()
            sent.wait(30)

        _hook(ctl, at, stale)
        assert there.wait(30), "the controllers did not reach the agreed round"
        handle = rt.allreduce_async(_data(3, r), name="m", op=rt.Sum)
        claim = ctl._fast.lane.claim
        assert claim is not None and claim.name == "m", "the op did not claim the lane"
        if late == "completion":
            claim.works[0] = _SeenLate(claim.works[0], 0.3)
            sent.set()
            time.sleep(hold_s)  # the peer's vote and this rank's round meet meanwhile
        else:
            _hand_over_after_the_end(ctl, sent)
        got = rt.synchronize(handle)
    else:
        # Round ``at`` carries this rank's shutdown vote: its last op completes once rank 0
        # claims, then its script ends (the harness calls shutdown()).
        def vote(mine: Message) -> None:
            deadline = time.monotonic() + 30
            while not ctl._end.shutdown and time.monotonic() < deadline:
                time.sleep(0.005)
            with ctl._lock:  # as the message would be built now
                mine.shutdown, mine.busy = ctl._end.shutdown, bool(ctl._pending)
            mine.lane = ctl._fast.lane.status()

        _hook(ctl, at, vote)
        got = rt.allreduce(_data(3, r), name="m", op=rt.Sum)
    torch.testing.assert_close(got, _data(3, 0) + _data(3, 1))
    return got[:4].tolist()


@pytest.mark.parametrize("late", ["completion", "hand-over"])
def test_an_op_in_a_slot_the_leaving_peer_matched_completes(world: spawn.World, late: str) -> None:
    results = world.run(_last_slot_then_leave, 0.5, late, timeout=TIMEOUT, fast_lane=True)
    assert results[0] == results[1]
    # The ranks are fine afterwards: the next job in the same processes runs.
    assert world.run(_last_slot_then_leave, 0.0, late, timeout=TIMEOUT, fast_lane=True)
