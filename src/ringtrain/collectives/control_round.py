"""One control round of a process set: every rank's message, gathered by every rank.

The controller (:mod:`ringtrain.collectives.controller`) negotiates by exchanging one
:class:`Message` per rank and cycle over the set's ``control`` group: the requests submitted
since the last round (or their numbers in the request cache), shutdown (and why) and doze votes,
rank 0's abort and cross-set verdicts, the fast lane's status, and the data of small collectives
(:func:`inline_payloads`). :class:`ControlChannel` is the wire: one allgather of fixed-size
slots per round, a second only when a message outgrows its slot.
"""

from __future__ import annotations

import pickle
import struct
import time
from dataclasses import dataclass, field

import torch

from ringtrain.collectives import inline, lane
from ringtrain.collectives.execute import Pending
from ringtrain.collectives.requests import Request
from ringtrain.runtime import abort, exit_guard
from ringtrain.runtime.communicator import Communicator
from ringtrain.transport import group_ops

# Control messages up to this size travel in one allgather; longer ones take a second round.
CONTROL_SLOT_BYTES = 8192


@dataclass
class Message:
    """One rank's part of a control round; every rank receives every rank's."""

    # A Request, or the number of one in the request cache, which every rank holds alike.
    requests: list[Request | int] = field(default_factory=list)
    shutdown: bool = False
    # With ``shutdown``: why this rank leaves, "" when its script ended or called shutdown();
    # a failure's summary ("ValueError: boom") when an uncaught exception ends it.
    leaving: str = ""
    # This rank has collectives in flight (negotiated or on the fast lane): a finished peer
    # keeps taking part in rounds until no rank has (see the controller's shutdown rules).
    busy: bool = False
    # This rank has been idle for DOZE_AFTER_IDLE_CYCLES: when every rank says so, all doze.
    idle: bool = False
    # Set by the set's rank 0 only: every rank aborts with this error.
    abort: str = ""
    # Set by the set's rank 0 only: (name, error) of collectives submitted on other sets too.
    mismatched: tuple[tuple[str, str], ...] = ()
    # Small collectives' data, by position in ``requests`` (see collectives.inline).
    inline: dict[int, inline.Payload] = field(default_factory=dict)
    # This rank's fast lane (see collectives.lane); None without one.
    lane: lane.Status | None = None


class ControlChannel:
    """The allgather of one message per rank over a set's ``control`` group. Its waits end
    when the world it was made in is replaced (elastic: ``world`` is that generation)."""

    def __init__(self, comm: Communicator, world: int) -> None:
        self._size = comm.size
        self._group = comm.group("control")
        self._world = world
        self._slot = torch.zeros(CONTROL_SLOT_BYTES, dtype=torch.uint8)
        self._slots = torch.zeros(comm.size * CONTROL_SLOT_BYTES, dtype=torch.uint8)
        self.rounds = 0  # exchanges so far: a protocol counter for tests and benchmarks
        # When the exchange in progress began (perf_counter); None between exchanges. A round
        # waits milliseconds unless a peer runs no Python (diagnostics.gil_watch reads it).
        self.started: float | None = None

    def exchange(self, msg: Message) -> list[Message]:
        """Allgather one pickled message per rank over the control group.

        Each Gloo collective costs a millisecond or more of thread hand-offs, so a cycle uses one:
        fixed-size slots that hold a length and the message. Only when some message outgrows its
        slot (every rank sees that in the lengths) does a second allgather carry the long ones.
        """
        self.rounds += 1
        if self._size == 1:
            return [msg]
        self.started = time.perf_counter()
        try:
            return self._exchange(msg)
        finally:
            self.started = None

    def _exchange(self, msg: Message) -> list[Message]:
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        # Preallocated slots, filled and read through memoryviews: a round runs every cycle, and
        # a dozen small torch ops cost as much CPU as the allgather itself.
        size, width = self._size, CONTROL_SLOT_BYTES
        slot, slots = self._slot, self._slots
        out = slot.numpy().data
        struct.pack_into("<q", out, 0, len(payload))
        if len(payload) <= width - 8:
            out[8 : 8 + len(payload)] = payload
        self._allgather(slots, slot)
        got = slots.numpy().data
        lengths = [struct.unpack_from("<q", got, r * width)[0] for r in range(size)]
        longest = max(lengths)
        if longest <= width - 8:
            return [
                pickle.loads(got[r * width + 8 : r * width + 8 + n]) for r, n in enumerate(lengths)
            ]
        big = torch.zeros(longest, dtype=torch.uint8)
        big.numpy().data[: len(payload)] = payload
        bigs = torch.empty(size * longest, dtype=torch.uint8)
        self._allgather(bigs, big)
        got = bigs.numpy().data
        return [pickle.loads(got[r * longest : r * longest + n]) for r, n in enumerate(lengths)]

    def _allgather(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        """The wire: every rank's ``mine`` into ``out``, in set-rank order (a simulated
        transport replaces this, see :mod:`ringtrain.collectives.simulated`)."""
        work = group_ops.all_gather_into(out, mine, self._group, async_op=True)
        abort.wait_work(exit_guard.hold(work), self._world)


def inline_payloads(subs: list[Pending], rank: int) -> dict[int, inline.Payload]:
    """The data of this message's small collectives, within the per-message budget."""
    out: dict[int, inline.Payload] = {}
    budget = inline.INLINE_MAX_PER_MESSAGE
    for i, p in enumerate(subs):
        try:
            payload = inline.encode(p.request, p.tensors, rank)
        except Exception:  # e.g. a tensor torch cannot read: the normal path reports it
            payload = None
        if payload is not None and len(payload[1]) <= budget:
            out[i] = payload
            budget -= len(payload[1])
    return out
