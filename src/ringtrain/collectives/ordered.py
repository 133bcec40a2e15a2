"""An allreduce whose floating-point sum adds every rank's value in rank order, wherever it lies.

Why: with three or more ranks, Gloo's ring sums an element in an order set by its offset in the
buffer (each chunk of the ring starts at another rank), so the bits of a fused op depend on
which other ops share its buffer and where it lands. Which async ops meet in one buffer depends
on timing, so a reproducible job could not fuse them (every async op was a Gloo call of its
own). Here every element is ``((x0 + x1) + x2) + ...`` whatever the buffer's layout, so ops fuse
in any grouping the negotiation happens to give and still sum to the same bits, run to run, on
a busy machine or a quiet one, fused, pipelined in chunks, or alone, and in the fast lane alike.

How: a direct reduce-scatter (one ``all_to_all_single``: rank r receives every rank's piece of
the r-th chunk of the buffer, as rows in rank order), the rows summed in rank order with
elementwise adds (an add is an add wherever it lies; ``stack.sum(0)`` is not: from 5 rows torch
reorders it by width), then the sums sent back to every rank by a second alltoall, straight into
the buffer. Wire bytes are a ring allreduce's, 2(N-1)/N of the buffer per rank; each exchange is
one step with its N-1 pieces in flight at once (the ring takes 2(N-1) steps); the adds are the
ring's adds. The costs: a scratch of the buffer's size, kept and reused; a copy of the sum into
the rows (N-1)/N of the buffer, so that the second alltoall has a piece for every rank; and no
overlap of the adds with the transfer, which Gloo's ring pipelines (pieces that would overlap
them are an experiment, off by default: :data:`PIECE_BYTES`). Measured at 3 ranks, 16 MiB,
on a loaded 2-core machine: 1.06-1.17x the CPU of Gloo's allreduce, and longer in wall time.

The other choice was fusion buckets fixed the first time a set of requests is seen (DDP, the
engine's planner). It would keep Gloo's ring, its bytes, latency and CPU; but it needs every member of a bucket to come again before the bucket can
run; Horovod's async API promises no such thing (a program may synchronize one op before it
submits the next), and the moment to give up waiting for a member would be a matter of timing
again. This way any grouping is right, with no state to keep or to invalidate.

Only floating-point (and complex) Sum, Average and Product go this way, and only from three
ranks: two ranks sum ``a + b``, the same either way round; integer sums and products wrap
alike in any order, and Min and Max pick a value: all of those take Gloo's ring as they are.
Host memory only (the scratch is): device tensors on 3+ ranks are still reduced one request
per buffer, on NCCL's ring.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
from typing import Any

import torch

from ringtrain.collectives import copies
from ringtrain.transport import group_ops

ORDERED_OPS = ("Sum", "Average", "Product")


# Above this size an op reduces alone, on Gloo's ring, as before fused ops reduced in rank order:
# fusion saves little per byte there, and the rank-ordered sum costs about twice the ring's CPU
# and 2-3x its wall time at 1-16 MiB (its adds do not overlap the transfer:
# docs/benchmarks/log/2026-11-28-ordered-fusion.md). Alone, an op's bits depend on its own size
# only, so this keeps reproducibility: the choice is a function of the op, never of timing.
ALONE_ABOVE_BYTES = 1 << 20
# A buffer above this many bytes may sum in pieces of this size, pipelined, IN_FLIGHT pieces at
# a time, each in a scratch of its own (see allreduce); 0: whole, the default. On 2 cores the
# pieces cost more than they hide (3 ranks, 16 MiB: 4 MiB pieces 1.50x the ring's wall, whole
# 1.24x; docs/benchmarks/log/2026-12-07-burst-wall.md): ranks that share cores have no idle
# core for the adds to overlap on. With a core per rank it is unmeasured:
# scripts/bench_scale_16core.sh times it at 8 and 16 ranks (scripts/bench_ordered_pieces.py).
PIECE_BYTES = 0
IN_FLIGHT = 2


def alone(nbytes: int) -> bool:
    """Whether an op of ``nbytes`` reduces alone on the ring instead of in rank order."""
    return nbytes > ALONE_ABOVE_BYTES


def wait_until(work: Any, deadline: float | None) -> None:
    """``work.wait()``, bounded by ``deadline`` (``time.monotonic()``) where one is given: the
    later half of a chained work (:class:`OrderedWork`, the lane's agreed slots) gets what the
    earlier half left of the caller's timeout."""
    if deadline is None:
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))


def needed(op: str, dtype: torch.dtype, size: int) -> bool:
    """Whether an allreduce of ``op`` over ``dtype`` on ``size`` ranks needs the rank order."""
    return size > 2 and op in ORDERED_OPS and (dtype.is_floating_point or dtype.is_complex)


class Scratch:
    """The bytes an ordered allreduce works in, kept for the next: a fresh buffer of tens of
    MiB is a fresh mmap whose page faults cost more than the copy. One op at a time; the
    pieces of a pipelined one (:func:`allreduce`) take one slot each."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._slots: list[Scratch] = []

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes].view(dtype)

    def slot(self, k: int) -> Scratch:
        """Scratch ``k`` of those that pieces in flight together use (0 is this one)."""
        if k == 0:
            return self
        while len(self._slots) < k:
            self._slots.append(Scratch())
        return self._slots[k - 1]


def chunk_starts(n: int, size: int) -> list[int]:
    """Where each rank's chunk of an ``n``-element buffer starts (ranks with an empty chunk
    have none)."""
    chunk = -(-n // size)
    return [r * chunk for r in range(size) if r * chunk < n]


class OrderedWork:
    """One ordered allreduce of ``flat`` (1-D, dense, host memory) in flight, in place. Like a
    torch work: ``is_completed()`` and ``wait(timeout=None)`` (a timeout raises the transport's
    error, and the work can be waited on again). Whichever thread finds the exchange done sums
    the rows and starts the second exchange.

    ``landing`` (the fast lane's slots, :mod:`~ringtrain.collectives.lane`): where a slot's
    dummy marks the first value of every rank's chunk with NaN, a rank that finds no NaN among
    its rows' first values knows every rank claimed for real, and the sum goes straight into
    ``flat``; otherwise it lands in ``landing`` (:attr:`result`), and ``flat`` stays as it was
    submitted until the slot's verdict. Each rank chooses for itself: the choice changes where
    its own bytes land, never what any rank sends."""

    def __init__(
        self,
        flat: torch.Tensor,
        op: str,
        group: Any,
        scratch: Scratch,
        landing: Scratch | None = None,
    ) -> None:
        self._flat, self._op, self._group = flat, op, group
        self._landing = landing
        self.result = flat  # where the sum is once completed
        n, size, me = flat.numel(), group.size(), group.rank()
        chunk = -(-n // size)
        self._sizes = [max(0, min(n, (r + 1) * chunk) - r * chunk) for r in range(size)]
        self._mine = self._sizes[me]
        # Every rank's piece of my chunk, one row per rank, in rank order.
        self._rows = scratch.take(size * self._mine, flat.dtype).view(size, self._mine)
        self._lock = threading.Lock()
        self._back: Any = None
        # The data moves as bytes, which every group moves for every dtype (complex, bfloat16).
        self._width = flat.element_size()
        self._exchange = group_ops.all_to_all(
            self._rows.view(-1).view(torch.uint8),
            flat.view(torch.uint8),
            [self._mine * self._width] * size,
            [k * self._width for k in self._sizes],
            group,
        )

    def _send_back(self) -> None:
        """Sum the rows in rank order, then send the sum to every rank, straight into ``flat``.
        An alltoall again, not an allgather: Gloo's allgather gathers into a buffer of its own,
        allocated per call, and copies out of it; this one takes uneven pieces as they are, for
        the price of copying the sum into the rows that are done with."""
        with self._lock:
            if self._back is not None:
                return
            self._exchange.wait()
            sure = self._landing is None or self._surely_real()  # before the sum overwrites
            rows = list(self._rows.unbind(0))
            acc = rows[0]
            for row in rows[1:]:  # rank order, elementwise: the layout cannot change a bit
                if self._op == "Product":
                    copies.mul_(acc, row)
                else:
                    copies.add_(acc, row)
            copies.copy_all_(rows[1:], [acc] * (len(rows) - 1))
            if not sure:
                assert self._landing is not None
                self.result = self._landing.take(self._flat.numel(), self._flat.dtype)
            self._back = group_ops.all_to_all(
                self.result.view(torch.uint8),
                self._rows.view(-1).view(torch.uint8),
                [k * self._width for k in self._sizes],
                [self._mine * self._width] * len(rows),
                self._group,
            )

    @property
    def landed(self) -> bool:
        """Whether the sum landed aside (in :attr:`result`), not in the buffer itself."""
        return self.result is not self._flat

    def _surely_real(self) -> bool:
        """Whether no rank's row starts with NaN (no dummy took part: a dummy marks every
        chunk's start). An empty chunk shows nothing, so it is never sure."""
        return self._mine > 0 and not bool(self._rows[:, 0].isnan().any())

    def is_completed(self) -> bool:
        return self._summed() and bool(self._back.is_completed())

    def _summed(self) -> bool:
        """Whether the rows are summed and the second exchange started (starting it if the
        first has landed)."""
        if self._back is None:
            if not self._exchange.is_completed():
                return False
            self._send_back()
        return True

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        self._first_half(deadline)
        wait_until(self._back, deadline)
        return True

    def _first_half(self, deadline: float | None) -> None:
        """Until the rows are summed and the second exchange started."""
        if self._back is None:
            if deadline is not None:
                wait_until(self._exchange, deadline)
            self._send_back()

    def summed(self) -> _Summed:
        """A work that is done once this one's rows are summed and its second exchange has
        started: what :func:`allreduce` waits for (sliced, as any work) between pieces."""
        return _Summed(self)


class _Summed:
    """The first half of an :class:`OrderedWork`, as a work: ``wait(timeout=None)``."""

    def __init__(self, work: OrderedWork) -> None:
        self._work = work

    def is_completed(self) -> bool:
        return self._work._summed()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        self._work._first_half(deadline)
        return True


def allreduce(flat: torch.Tensor, op: str, group: Any, scratch: Scratch) -> None:
    """``flat`` (1-D, dense) summed (or multiplied) over ``group`` in rank order, in place.

    Where :data:`PIECE_BYTES` is set, a buffer above it sums in pieces of that size, pipelined
    (an experiment, off by default): while one piece's first exchange moves, this thread sums
    the rows of the piece before and starts its second, so the adds overlap the transfer as in
    Gloo's ring. Every rank cuts alike (by size alone) and starts the same exchanges in the same
    order: first(0), first(1), second(0), first(2), second(1), ... Each element still sums in
    rank order: a piece changes no bit."""
    step = max(1, PIECE_BYTES // flat.element_size()) if PIECE_BYTES else flat.numel()
    if flat.numel() <= step:
        group_ops.finish(OrderedWork(flat, op, group, scratch), flat)
        return
    flying: collections.deque[OrderedWork] = collections.deque()
    for i, start in enumerate(range(0, flat.numel(), step)):
        if len(flying) == IN_FLIGHT:  # its scratch slot is this piece's: let it land first
            group_ops.finish(flying.popleft(), flat)
        piece = flat[start : start + step]
        flying.append(OrderedWork(piece, op, group, scratch.slot(i % IN_FLIGHT)))
        if len(flying) > 1:  # sum the piece before while this one's exchange moves
            group_ops.finish(flying[-2].summed(), flat)
    while flying:
        group_ops.finish(flying.popleft(), flat)
