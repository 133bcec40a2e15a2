"""The controller's fast lane: ops that repeat the reserved request skip negotiation.

:mod:`ringtrain.collectives.lane` holds the lane itself (slots, claims, flags); this module is
its driver, an object the :class:`~ringtrain.collectives.controller.Controller` owns
(:class:`LaneDriver`). A submitted op
that matches the reservation claims a slot and gets a :class:`LaneHandle`; waiting on it takes
the slot's verdict: a valid slot gives the result, an invalid one sends the op through the
ordinary negotiation from the tensor as it was submitted. In each control round the lane's
share (:meth:`LaneDriver.round`) releases a slot a peer waits in while this rank is busy
elsewhere (this rank's own decision), and opens, moves or gives up the reservation from what
every rank received alike, so every rank decides the same.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from ringtrain.collectives import lane
from ringtrain.collectives.execute import Pending, transport_error
from ringtrain.collectives.handles import Handle
from ringtrain.collectives.requests import Request
from ringtrain.collectives.scaling import scaling_of
from ringtrain.collectives.vector_round import LaneView
from ringtrain.compression.averaging import Factors
from ringtrain.diagnostics import timeline
from ringtrain.runtime import abort
from ringtrain.runtime.communicator import Communicator

# At shutdown, how long a rank waits for the peers to complete the lane slots it claimed.
LANE_DRAIN_S = 10.0
# ... and when a peer failed: the job ends anyway, and the peer's exit breaks the slot's wait.
LANE_DRAIN_FAILED_S = 1.0


class LaneHandle(Handle[Any]):
    """The handle of an op that claimed a lane slot: waiting on it takes the slot's verdict,
    then gives the result, or (the slot was not valid) waits for the negotiated op."""

    __slots__ = ("_driver", "claim")

    def __init__(
        self,
        name: str,
        finish: Callable[[Any], Any] | None,
        driver: LaneDriver,
        claim: lane.Claim | None = None,
    ) -> None:
        super().__init__(name, finish)
        self._driver = driver
        self.claim: lane.Claim | None = claim

    def done(self) -> bool:
        if self.claim is not None and not self._finished:
            self._driver.progress(self, block=False)
        return self._finished

    def wait(self, timeout: float | None = None) -> Any:
        if self.claim is not None and not self._finished:
            self._driver.progress(self, block=True)
        return super().wait(timeout)


def split_settled(pending: dict[str, Pending]) -> tuple[dict[str, Pending], dict[str, Pending]]:
    """``pending`` as (ops the set's end fails, ops whose lane slot came out valid). The latter
    completed on every rank: the thread that took the verdict hands each its result over
    (:meth:`LaneDriver._finish` finds it pending), even where a peer that matched the slot has
    left and the set ended between the verdict and the hand-over."""
    settled = {
        name: p
        for name, p in pending.items()
        if isinstance(p.handle, LaneHandle) and p.handle.claim is not None and p.handle.claim.valid
    }
    return {n: p for n, p in pending.items() if n not in settled}, settled


class LaneHost(Protocol):
    """What the lane's driver asks of its controller (the pending ops are the controller's)."""

    def pending_of(self, name: str) -> Pending | None: ...

    def drop_pending(self, name: str) -> None: ...

    def renegotiate(self, name: str, handle: LaneHandle) -> None:
        """The op's slot was not valid: negotiate it as any other (or fail it, the set ended)."""

    def wake(self) -> None:
        """Wake the controller, and the peers' controllers if they doze."""


class LaneDriver:
    """The controller's fast lane, owned by it: the lane, what the rounds decided about it
    (:class:`Reservation`), and whether a claim of this rank keeps the controllers polling."""

    def __init__(
        self,
        fast: lane.Lane,
        host: LaneHost,
        lock: threading.Lock,
        comm: Communicator,
        clock: Callable[[], float],
    ) -> None:
        self.lane = fast
        self.reservation = Reservation()
        # Whether a claim of ours has waited long enough to keep the controllers polling.
        self.nudged = False
        # Weak: the controller owns this driver, and a cycle would keep the controller (and its
        # process groups' sockets) alive after shutdown until the cyclic collector ran.
        self._host: LaneHost = weakref.proxy(host)
        self._lock = lock  # the controller's: ``nudged`` is read under it
        self._comm = comm
        self._clock = clock
        self._world = abort.generation  # elastic: waits end when this world is replaced
        self._factors: tuple[Request, Factors] | None = None  # the last claim's (_scaling)

    def quiet(self) -> bool:
        """Nothing of the lane's keeps the controllers polling (a doze vote's part)."""
        return not self.nudged and self.reservation.peer is None

    def progress(self, handle: LaneHandle, block: bool) -> None:
        """Take the verdict of ``handle``'s slot (waiting for it when ``block``) and act on it."""
        fast, claim = self.lane, handle.claim
        if claim is None:
            return
        try:
            while True:
                if block:
                    self._wait(claim)
                settled = fast.settle(claim)
                # Not settled: still in flight, taken by another thread, or the flags' round
                # just started (then wait for that too).
                if settled is not None or not block or fast.claim is not claim:
                    break
        except Exception as e:  # the transport failed: this op fails, the controller follows
            self._host.drop_pending(handle.name)
            handle.claim = None
            if not handle.done():  # the set's end may have told it why already
                handle.set_error(transport_error(e))
            return
        if settled is not None:
            self._finish(settled)

    def _wait(self, claim: lane.Claim) -> None:
        """Wait for a claim's collectives. They complete once every rank has claimed the slot;
        if that takes long, the peers may not know of the claim (their controllers doze), so
        wake the controllers and keep them polling until the slot is settled."""
        for work in claim.works:  # settle() replaces the list, never changes it
            if not lane.wait_for(work, lane.NUDGE_S):
                with self._lock:
                    self.nudged = True
                self._host.wake()
                abort.wait_work(work, self._world)

    def settle(self) -> None:
        """The controller's share: settle a slot nobody waits for (dummies, unwaited ops)."""
        try:
            settled = self.lane.settle()
        except Exception:
            return  # its waiter (if any) reports it; a dead peer fails the next round too
        if settled is not None:
            self._finish(settled)

    def drain(self, timeout_s: float) -> None:
        """See this rank's claims through and end their ops (at most ``timeout_s``): when the
        set ends, a peer that has left may have matched a claim this rank made after its last
        round's message, and that op completes rather than fail (a valid slot gives its result,
        a lost one the set's failure)."""
        for claim in self.lane.drain(timeout_s):
            self._finish(claim)

    def drain_at_end(self, failed: bool, leaving: bool) -> None:
        """The set ends (``failed``: a peer failed; ``leaving``: this rank fails): a lane op
        claimed after this rank's last message was built may have been matched by the leaving
        peer already, and then it completes rather than fail. None where this rank fails."""
        self.drain(0.0 if leaving else LANE_DRAIN_FAILED_S if failed else LANE_DRAIN_S)

    def _finish(self, claim: lane.Claim) -> None:
        """Complete a settled claim: a valid slot gives the result; otherwise the op is
        negotiated as any other, from the tensor as it was submitted."""
        self.nudged = False
        if claim.name is None:
            return
        local = self._host.pending_of(claim.name)
        if local is None or not isinstance(local.handle, LaneHandle):
            return  # failed meanwhile (shutdown, a peer's failure)
        handle = local.handle
        if claim.valid:
            self._scaling(claim).after(claim.data)
            rec = timeline.current()
            if rec.enabled:
                rec.span(
                    f"collectives set {self._comm.set_id}",
                    "ALLREDUCE (lane)",
                    claim.started,
                    time.perf_counter(),
                    {"tensors": [claim.name], "count": 1},
                )
            self._host.drop_pending(claim.name)
            handle.claim = None
            handle.set_result(local.outputs or local.tensors)
            return
        handle.claim = None  # its tensor is as submitted (Lane._verdict restored it)
        self._host.renegotiate(claim.name, handle)

    def _scaling(self, claim: lane.Claim) -> Factors:
        """The claim's scale factors, worked out once per reservation, not per op."""
        memo = self._factors
        if memo is None or memo[0] is not claim.request:
            factors = scaling_of(claim.request, self._comm.size, claim.data.dtype)
            memo = self._factors = (claim.request, factors)
        return memo[1]

    def round(self, view: LaneView, ran: list[Request], busy: bool) -> None:
        """The lane's share of a round, before the ready ops run (``ran``: the ready requests
        that may ride the lane, in run order; ``busy``: this rank waits on other ops or shuts
        down); see :class:`Reservation`."""
        self.settle()
        self.reservation.decide(self.lane, view, ran, self._clock(), busy)


class Slots(Protocol):
    """What :class:`Reservation` uses of a lane (:class:`~ringtrain.collectives.lane.Lane`)."""

    def status(self) -> lane.Status: ...

    def doom(self, slot: int) -> None: ...

    def open_at(self, slot: int, request: Request) -> bool: ...


class Reservation:
    """What the rounds decided about the lane on this rank: the request of its last opening,
    eligible requests negotiated since while it went unused, and a peer's claim this rank has
    not matched. The controller owns one; :meth:`decide` is the lane's share of each round."""

    def __init__(self) -> None:
        self.request: Request | None = None
        self._misses: dict[Request, int] = {}
        self._used = 0  # the lowest next slot of the ranks, at the last round
        # This rank only: (slot, first seen) of a peer's claim this rank has not matched.
        self.peer: tuple[int, float] | None = None

    def decide(
        self, fast: Slots, view: LaneView, ran: list[Request], now: float, busy: bool
    ) -> None:
        """Releasing a slot is this rank's own decision (``busy``: it waits on other ops or
        shuts down); opening and giving up the reservation are decided from what every rank
        received alike (``view``, from gathered messages or a vector round, and ``ran``, the
        ready requests that may ride the lane, in run order), so every rank decides the same."""
        # Release: a peer waits in the current slot while this rank is busy elsewhere.
        mine = fast.status()
        if mine.slot not in view.claims or mine.claimed or not mine.open:
            self.peer = None
        else:
            if self.peer is None or self.peer[0] != mine.slot:
                self.peer = (mine.slot, now)
            if busy or mine.slot in view.dummies or now - self.peer[1] >= lane.RELEASE_S:
                fast.doom(mine.slot)
                self.peer = None
        # Open, or give up the reservation: from the view and the ready requests only.
        if not ran:
            return
        if view.all_closed and view.slot_min == view.slot_max:
            if fast.open_at(view.slot_min, ran[-1]):
                self.request = ran[-1]
                self._misses.clear()
        elif view.all_open:
            # A request negotiated again and again while the reservation goes unused takes it.
            if view.free_min > self._used or len(self._misses) > 64:
                self._misses.clear()
            self._used = view.free_min
            for req in ran:
                if req == self.request:
                    continue
                self._misses[req] = self._misses.get(req, 0) + 1
                if self._misses[req] >= lane.SWITCH_AFTER:
                    fast.doom(view.free_max)
                    self._misses.clear()
                    break
