"""The lane's share of a round (lane_control.Reservation) as a pure function of what the round
told: release, open and switch, without processes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ringtrain.collectives import lane
from ringtrain.collectives.lane_control import Reservation
from ringtrain.collectives.requests import Request, TensorMeta
from ringtrain.collectives.vector_round import LaneView


@dataclass
class FakeLane:
    """What Reservation calls of a lane: its status, and the decisions it records."""

    slot: int = 0
    claimed: bool = False
    reserved: Request | None = None
    doomed: list[int] = field(default_factory=list)

    def status(self) -> lane.Status:
        return lane.Status(self.slot, self.claimed, False, self.reserved is not None)

    def doom(self, slot: int) -> None:
        self.doomed.append(slot)

    def open_at(self, slot: int, request: Request) -> bool:
        self.reserved = request
        return slot == self.slot


def _req(name: str) -> Request:
    return Request(name, "allreduce", (TensorMeta((4096,), "torch.float32"),), op="Sum")


CLOSED = LaneView(all_open=False, all_closed=True, slot_min=0, slot_max=0, free_min=0,
                  free_max=0, claims=frozenset(), dummies=frozenset())  # fmt: skip


def _view(**changes: Any) -> LaneView:
    return dataclasses.replace(CLOSED, **changes)


def test_opens_for_the_last_ready_request_when_every_lane_is_closed_at_one_slot() -> None:
    fast, res = FakeLane(), Reservation()
    res.decide(fast, _view(), [_req("a"), _req("b")], now=0.0, busy=False)
    assert fast.reserved == _req("b") and res.request == _req("b")
    fast2 = FakeLane()
    Reservation().decide(fast2, _view(slot_max=1), [_req("a")], 0.0, False)
    assert fast2.reserved is None  # the ranks' lanes are at different slots: not alike


def test_a_peer_waiting_in_this_rank_s_slot_is_released_when_busy_or_after_a_while() -> None:
    fast, res = FakeLane(slot=5, reserved=_req("a")), Reservation()
    view = _view(all_open=True, all_closed=False, slot_min=5, slot_max=5, claims=frozenset({5}))
    res.decide(fast, view, [], now=10.0, busy=False)
    assert fast.doomed == [] and res.peer == (5, 10.0)  # noticed, not yet released
    res.decide(fast, view, [], now=10.0 + lane.RELEASE_S, busy=False)
    assert fast.doomed == [5] and res.peer is None
    Reservation().decide(fast, view, [], now=0.0, busy=True)
    assert fast.doomed == [5, 5]  # busy elsewhere: at once


def test_a_request_negotiated_again_and_again_takes_the_unused_lane() -> None:
    fast, res = FakeLane(slot=3, reserved=_req("a")), Reservation()
    res.request = _req("a")
    view = _view(all_open=True, all_closed=False, slot_min=3, slot_max=3, free_min=3, free_max=4)
    for _ in range(lane.SWITCH_AFTER):
        res.decide(fast, view, [_req("b")], now=0.0, busy=False)
    assert fast.doomed == [4]  # every rank gives the lane up at the highest next free slot
