"""A control round whose cost does not grow with the rank count: one bit vector, one allreduce.

A gathered round (:mod:`~ringtrain.collectives.control_round`) brings every rank's message to
every rank: (N-1) slots of 8 KiB in N-1 sequential steps and N decodes, per rank and round. Most
rounds of a training job carry nothing new, though: the same named collectives as last step,
which every rank already holds in the request cache under the same number. So from
``Config.vector_rounds_from`` ranks a round is, as in Horovod's response cache, a vector of
64-bit words combined with one bitwise-AND allreduce:

- one bit per cache number: this rank has that request pending. After the AND, a set bit means
  every rank has it: the op is ready, and ready ops run in cache-number order, alike everywhere;
- flags: AND ones (every rank is idle, every lane is open) and OR ones, sent inverted (some rank
  wants a gathered round next: it submitted a request the cache does not hold, votes to shut
  down, is rank 0 with an abort or a cross-set verdict, or has waited :data:`PATIENCE_S` for
  peers that may have sent something else under that name);
- the fast lane's status (:mod:`~ringtrain.collectives.lane`): slot numbers relative to a base
  every rank agreed on, as thermometer codes (the AND of ``2**v - 1`` is ``2**min - 1``, the AND
  of its complement gives the max) and masks of claimed slots, so the lane decides from a round
  exactly what it decides from gathered messages (:class:`LaneView`).

Its size is ``HEADER_WORDS + ceil(cache entries / 64)`` words, whatever the rank count. A round
that some rank flagged is followed by a gathered one, where every rank's pending cached
requests join the table as gathered messages carry them, so name matching, mismatch reports,
stall reports, joins and shutdown votes work exactly as in gathered rounds. A gathered round that
carried uncached requests, or left names waiting, is followed by another (the controller's rule):
unnamed ops are new every time, and each would otherwise cost a vector round and a gathered one.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ringtrain.collectives import lane
from ringtrain.collectives.requests import Alike, Request
from ringtrain.runtime import abort, exit_guard
from ringtrain.runtime.communicator import Communicator
from ringtrain.transport import group_ops

# A cached request pending on this rank for this long without becoming ready goes to a gathered
# round: a peer may have submitted another request under its name (a mismatch, reported there),
# and the stall inspector and cross-set checks read the gathered table.
PATIENCE_S = 1.0
# Lane slots are coded relative to the agreed base within this window (a 64-bit thermometer
# holds 0-63, and a claimed slot's next free one must fit too); a rank further ahead asks for a
# gathered round, which carries its status whole.
WINDOW = 62

ONES = 0xFFFF_FFFF_FFFF_FFFF

# Word 0: flags. AND flags are sent as they are; OR flags inverted (the AND of "not x" is "no
# rank has x").
F_NO_GATHER = 1 << 0  # inverted: no rank wants a gathered round next
F_IDLE = 1 << 1  # every rank idle long enough to doze
F_LANE = 1 << 2  # every rank has a lane whose status fits in the vector
F_OPEN = 1 << 3  # every lane holds a reservation
F_CLOSED = 1 << 4  # every lane neither reserved nor claimed
# Words 1-6: the lane (thermometers of slot and next free slot, min and max; masks of claims).
W_FLAGS, W_SLOT_LO, W_SLOT_HI, W_FREE_LO, W_FREE_HI, W_CLAIMS, W_DUMMIES = range(7)
HEADER_WORDS = 7


@dataclass(frozen=True)
class LaneView:
    """What a round tells about every rank's lane: all a lane decision needs (lane_control)."""

    all_open: bool
    all_closed: bool  # every lane neither reserved nor claimed
    slot_min: int
    slot_max: int
    free_min: int  # lowest next free slot
    free_max: int
    claims: frozenset[int]  # slots some rank has claimed
    dummies: frozenset[int]  # slots some rank has claimed as a dummy

    @classmethod
    def of(cls, statuses: Iterable[lane.Status | None]) -> LaneView | None:
        """From gathered messages; None unless every rank has a lane."""
        known = list(statuses)
        if not known or any(st is None for st in known):
            return None
        sts = [st for st in known if st is not None]
        return cls(
            all_open=all(st.open for st in sts),
            all_closed=all(not st.open and not st.claimed for st in sts),
            slot_min=min(st.slot for st in sts),
            slot_max=max(st.slot for st in sts),
            free_min=min(st.next_free for st in sts),
            free_max=max(st.next_free for st in sts),
            claims=frozenset(st.slot for st in sts if st.claimed),
            dummies=frozenset(st.slot for st in sts if st.claimed and st.dummy),
        )


@dataclass(frozen=True)
class Summary:
    """A vector round, combined: the same on every rank."""

    gather_next: bool  # some rank wants a gathered round next
    idle: bool  # every rank may doze
    ready: list[int]  # cache numbers every rank has pending, ascending
    lane: LaneView | None  # None: no lane, or some status did not fit (a gathered round follows)


def fits(status: lane.Status, base: int) -> bool:
    """Whether a lane status can be coded relative to ``base``."""
    return 0 <= status.slot - base <= WINDOW


def encode(
    words: int,
    pending: Iterable[int],
    gather: bool,
    idle: bool,
    status: lane.Status | None,
    base: int,
) -> np.ndarray:
    """This rank's vector: ``words`` 64-bit words (see :func:`words_for`). Built in Python
    ints, then one array: per round, numpy's per-call cost would outweigh the work."""
    flags = 0 if gather else F_NO_GATHER
    if idle:
        flags |= F_IDLE
    if status is not None and fits(status, base):
        flags |= F_LANE
        if status.open:
            flags |= F_OPEN
        if not status.open and not status.claimed:
            flags |= F_CLOSED
        slot, free = status.slot - base, status.next_free - base
        claim = ONES ^ (1 << slot) if status.claimed else ONES
        dummy = claim if status.dummy else ONES
        lane_words = [
            _thermometer(slot),
            ONES ^ _thermometer(slot),
            _thermometer(free),
            ONES ^ _thermometer(free),
            claim,
            dummy,
        ]
    else:
        lane_words = [ONES] * (HEADER_WORDS - 1)  # the AND's identity: says nothing
    body = 0
    for cid in pending:
        body |= 1 << cid
    v = np.empty(words, dtype=np.uint64)
    v[:HEADER_WORDS] = [flags, *lane_words]
    v[HEADER_WORDS:] = np.frombuffer(body.to_bytes((words - HEADER_WORDS) * 8, "little"), "<u8")
    return v


def decode(v: np.ndarray, base: int) -> Summary:
    """The AND of every rank's :func:`encode`."""
    header = v[:HEADER_WORDS].tolist()
    flags = header[W_FLAGS]
    bits = np.unpackbits(v[HEADER_WORDS:].view(np.uint8), bitorder="little")
    view = None
    if flags & F_LANE:
        view = LaneView(
            all_open=bool(flags & F_OPEN),
            all_closed=bool(flags & F_CLOSED),
            slot_min=base + header[W_SLOT_LO].bit_count(),
            slot_max=base + (ONES ^ header[W_SLOT_HI]).bit_count(),
            free_min=base + header[W_FREE_LO].bit_count(),
            free_max=base + (ONES ^ header[W_FREE_HI]).bit_count(),
            claims=_slots(ONES ^ header[W_CLAIMS], base),
            dummies=_slots(ONES ^ header[W_DUMMIES], base),
        )
    return Summary(
        gather_next=not flags & F_NO_GATHER,
        idle=bool(flags & F_IDLE),
        ready=np.flatnonzero(bits).tolist(),
        lane=view,
    )


def words_for(cache_entries: int) -> int:
    """The vector's length for a cache of ``cache_entries`` requests (alike on every rank)."""
    return HEADER_WORDS + math.ceil(cache_entries / 64)


def _thermometer(v: int) -> int:
    return (1 << v) - 1


def _slots(mask: int, base: int) -> frozenset[int]:
    found = []
    while mask:  # one pass per set bit: usually none or one
        low = mask & -mask
        found.append(base + low.bit_length() - 1)
        mask ^= low
    return frozenset(found)


class VectorChannel:
    """The bitwise AND of one vector per rank over a set: recursive doubling on the set's
    2-rank groups (:meth:`~ringtrain.runtime.communicator.Communicator.pair_groups`), one
    allreduce per step: log2 N steps (2 more where N is not a power of two), against Gloo's
    ring's 2(N-1) on the ``control`` group, which serves where the set made no pairs.
    Where a host's ranks are consecutive and a power of two in number, the first steps stay
    on the host. Each step is a collective on its own group, so its wait can be sliced (an
    elastic re-forming ends it: :func:`ringtrain.runtime.abort.wait_work`); on Gloo's
    point-to-point operations a timed wait that runs out closes every connection of the
    group ("Application timeout caused pair closure", torch 2.13)."""

    def __init__(self, comm: Communicator, world: int) -> None:
        self._size = comm.size
        pairs = comm.pair_groups() if comm.size > 1 else []
        self._steps: list[Any] = pairs or ([comm.group("control")] if comm.size > 1 else [])
        self._world = world
        self.rounds = 0  # exchanges so far: a protocol counter for tests and benchmarks
        self.started: float | None = None  # as ControlChannel.started
        if pairs:
            # Connect the pairs now, on every member alike (the controller is made at init or
            # add_process_set, collectively): a broken pair fails there, not in a round, and
            # a rank holds the same sockets from the start (host/connections.py counts them).
            self._reduce(torch.zeros(1, dtype=torch.int64))

    def exchange(self, v: np.ndarray) -> np.ndarray:
        self.rounds += 1
        if self._size == 1:
            return v
        t = torch.from_numpy(v.view(np.int64))
        self.started = time.perf_counter()
        try:
            self._reduce(t)
        finally:
            self.started = None
        return t.numpy().view(np.uint64)

    def _reduce(self, t: torch.Tensor) -> None:
        for group in self._steps:
            self._allreduce(t, group)

    def _allreduce(self, t: torch.Tensor, group: Any) -> None:
        """One step on the wire (a simulated transport replaces this, see
        collectives.simulated)."""
        work = group_ops.allreduce(t, group, "band", async_op=True)
        abort.wait_work(exit_guard.hold(work), self._world)


class VectorRounds:
    """A controller's vector-round state on this rank (the controller owns one)."""

    def __init__(self, channel: VectorChannel) -> None:
        self.channel = channel
        # This rank's cached requests announced by bits only: cache number -> (name, since).
        self.pending: dict[int, tuple[str, float]] = {}
        self.gather_next = False  # agreed: the next round is a gathered one
        self.base = 0  # agreed: the lane slot the vector's lane codes count from
        # Rank 0's cross-set verdicts found in a vector round, sent in the gathered one.
        self.carried: tuple[tuple[str, str], ...] = ()
        self._alike: dict[int, Alike] = {}
        # Why a gathered round came next, by cause (a protocol counter, as channel.rounds): the
        # first of this rank's reasons when it flagged one ("uncached", "joined", "late": a name
        # the table holds, "shutdown", "overdue", "lane", "verdict", "abort"), or the gathered
        # round's own rule ("fresh", "waiting": alike on every rank).
        self.why: Counter[str] = Counter()

    def overdue(self, now: float) -> bool:
        """Whether a request has waited PATIENCE_S. Entries go in as they are submitted, so
        the first one left is the oldest."""
        oldest = next(iter(self.pending.values()), None)
        return oldest is not None and now - oldest[1] >= PATIENCE_S

    def alike(self, cid: int, request: Request, size: int) -> Alike:
        """The by-rank map of a cache hit, made once per cache number."""
        got = self._alike.get(cid)
        if got is None:
            got = self._alike[cid] = Alike(request, size)
        return got

    def asks(self, why: str) -> bool:
        """Whether this rank asks for a gathered round next (``why``: its reason, or "")."""
        if why:
            self.why[why] += 1
        return bool(why)

    def gathered(self, fresh: bool, waiting: bool) -> None:
        """After a gathered round (alike on every rank): another follows if it carried uncached
        requests (unnamed ops come in runs) or left names waiting for some rank."""
        self.gather_next = fresh or waiting
        if self.gather_next:
            self.why["fresh" if fresh else "waiting"] += 1

    def take_all(self) -> list[str]:
        """The names pending by bits, in cache order, to go into a gathered round's table."""
        names = [self.pending[c][0] for c in sorted(self.pending)]
        self.pending.clear()
        return names
