"""The fast lane: a repeated allreduce starts at once, with no negotiation round before it.

A negotiated collective waits for one controller round (an allgather of every rank's requests)
before its data moves; for a 256 KiB-4 MiB allreduce that round costs 5-50% of the transfer.
Most such ops repeat: the same name, shape and dtype every step. So each process set keeps one
*reservation*, agreed in a controller round like every other decision: "the next collective of
the lane is this request". The lane is a sequence of *slots* on a Gloo group of its own
(``lane``), the same sequence on every rank. A rank that submits exactly the reserved request
claims the current slot at once, on the caller's thread, and starts the allreduce there: one
Gloo collective, as a plain ``torch.distributed.all_reduce`` would be.

Every rank must take part in every slot, so a rank that does not submit the reserved request in
time claims the slot as a *dummy*: ``-0.0`` everywhere (the identity of a floating-point sum,
signed zeros included), except a NaN in the first value. Its controller decides that
(:meth:`Lane.doom`) when a peer's claim shows in a round and this rank is busy elsewhere: it
waits on other collectives, it joined or is shutting down, a peer claimed a dummy, or the claim
waited :data:`RELEASE_S`. Every rank then sees the same result, so it decides alike: a first
value that is not NaN means every rank claimed the slot for real, and the slot is *valid*; a
NaN (a dummy's, or one in the data itself) makes every rank allreduce a one-element flag (1: a
real claim) to tell. A valid slot's result is exactly the normal path's: 2 ranks sum ``a + b``
in either order; from 3 the slot reduces as the executor does, in rank order
(:mod:`~ringtrain.collectives.ordered`) when reproducible, else on the same Gloo ring over a
buffer of the same size. Otherwise the lane closes on every rank, each real claimant gets its
tensor back as it was, and the op is negotiated as any other, so name matching, mismatch
reports (which list every rank's submission) and stall reports work as before. How the tensor
is kept: 2 ranks change only its first value (kept as a number at the claim); from 3 ranks a
rank-ordered sum lands aside unless the rank already knows that every claim is real (a dummy
marks every rank's chunk, :class:`~ringtrain.collectives.ordered.OrderedWork`), a slot above
1 MiB agrees on the claims before its data moves (:mod:`~ringtrain.collectives.agreed`), and
only Gloo's ring up to 1 MiB (``reproducible=False``) copies the tensor at the claim into a
backup buffer the lane keeps (on the caller's thread alone: :mod:`~ringtrain.collectives.copies`).

The lane opens, deterministically, at a controller round that ran an eligible request on every
rank, for that request; a reservation that goes unused while another eligible request is
negotiated again and again (:data:`SWITCH_AFTER` times) is given up the same way (every rank
claims the next slot as a dummy), so the lane follows what a program repeats. One reservation
per process set: of several names used in turn, one rides the lane and the others are
negotiated.

What may ride the lane (:func:`eligible`): an allreduce (Sum or Average, no prescale) of one
contiguous CPU tensor of a floating-point type (integers cannot hold the dummy's NaN; 16-bit
averages divide before the sum), larger than what travels inline in the negotiation round
(:mod:`ringtrain.collectives.inline`), submitted alike by every rank. ``Config.fast_lane``
(``RINGTRAIN_FAST_LANE=0``) turns the lane off.
"""

from __future__ import annotations

import datetime
import enum
import functools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ringtrain.collectives import agreed, copies, dtypes, inline, ordered, resubmit
from ringtrain.collectives.requests import Request
from ringtrain.compression import averaging
from ringtrain.transport import group_ops

# A real claim waits at most this long for a rank that is not busy elsewhere before that rank's
# controller releases the slot (the op is then negotiated, and the stall inspector sees it).
RELEASE_S = 1.0
# A claim that has waited this long wakes the controllers (they may doze between rounds), so
# that the ranks that have not claimed learn of it.
NUDGE_S = 0.25
_NUDGE = datetime.timedelta(seconds=NUDGE_S)  # made once: a waiting claim's first wait
# An eligible request negotiated this many times while the reservation went unused takes the
# lane (the reservation is given up, then the lane reopens for the next eligible request).
SWITCH_AFTER = 2

# Floating point only: a dummy marks its slot with a NaN, which integers cannot hold.
_DTYPES = {"torch.float32", "torch.float64", "torch.float16", "torch.bfloat16"}


def eligible(req: Request) -> bool:
    """Whether ``req`` may ride the lane (the tensors themselves are checked at the claim):
    asked of every ready op in every round, so worked out once per request object."""
    return req.derived("lane", _eligible)


def _eligible(req: Request) -> bool:
    if req.kind != "allreduce" or req.error or len(req.tensors) != 1 or req.prescale != 1.0:
        return False
    if req.op not in ("Sum", "Average"):
        return False
    meta = req.tensors[0]
    if meta.device != "cpu" or meta.dtype not in _DTYPES:
        return False
    dtype = dtypes.from_name(meta.dtype)
    if req.op == "Average" and averaging.factors(True, 2, dtype).pre != 1.0:
        return False  # the average divides before the sum (16-bit): the tensor would change
    return _nbytes(req) > inline.INLINE_MAX_BYTES


def _nbytes(req: Request) -> int:
    """The bytes of a one-tensor request."""
    meta = req.tensors[0]
    return math.prod(meta.shape) * dtypes.from_name(meta.dtype).itemsize


class Status(NamedTuple):
    """One rank's lane, as its control message reports it."""

    slot: int  # the slot claimed (when ``claimed``), else the next one to claim
    claimed: bool
    dummy: bool  # the claim is a dummy: the slot cannot be valid
    open: bool  # a reservation stands

    @property
    def next_free(self) -> int:
        return self.slot + 1 if self.claimed else self.slot


class _Plan(enum.Enum):
    """How a reservation's slots run: Sum or Average of floats (see eligible()), as the
    executor would run the op; decided by the slot's bytes and the rank count alike on every
    rank."""

    AGREED = "agreed"  # from 3 ranks, above 1 MiB: the claims agree before the data moves
    ASIDE = "aside"  # in rank order (reproducible, 3+ ranks): the sum lands aside
    RING = "ring"  # Gloo's ring sum in place (2 ranks, or not reproducible up to 1 MiB)

    @classmethod
    def of(cls, nbytes: int, size: int, in_order: bool) -> _Plan:
        if agreed.agrees(nbytes, size):
            return cls.AGREED
        if in_order and not ordered.alone(nbytes):
            return cls.ASIDE  # above ordered.ALONE_ABOVE_BYTES the executor runs it alone too
        return cls.RING


class _Repeat(NamedTuple):
    """The reservation, worked out once when the lane opens: the caller's arguments that
    submit exactly it (:meth:`Lane.repeat_of`), and how its slots run."""

    repeat: resubmit.Repeat | None
    plan: _Plan

    @classmethod
    def of(cls, req: Request, size: int, in_order: bool) -> _Repeat:
        return cls(resubmit.of(req), _Plan.of(_nbytes(req), size, in_order))


@dataclass
class Claim:
    """This rank's part in one slot."""

    slot: int
    request: Request
    name: str | None  # None: a dummy
    data: torch.Tensor
    first: torch.Tensor  # data's first value (a view): NaN where a dummy took part
    works: list[Any]  # in flight: the data's allreduce, then (if needed) the flags'
    started: float
    restore: Callable[[], object] | None = None  # puts the tensor back, on a lost slot
    agreed: agreed.AgreedWork | None = None  # a slot that agrees before its data moves
    ordered: ordered.OrderedWork | None = None  # a rank-ordered sum: where it landed
    flag: torch.Tensor | None = None
    valid: bool | None = None

    def completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class Lane:
    """One process set's lane on this rank. Users claim slots on their own threads; the
    controller thread opens the lane, dooms slots and settles claims nobody waits for."""

    def __init__(self, size: int, group: Any, reproducible: bool = True) -> None:
        self.size = size
        self._group = group
        # As the executor: floating-point sums in rank order from three ranks (reproducible),
        # so that a slot's result is the negotiated path's, bit for bit.
        self._in_order = reproducible and size > 2
        self._scratch = ordered.Scratch()
        self._landing = ordered.Scratch()  # a rank-ordered sum not surely valid lands here
        self._lock = threading.Lock()
        self.slot = 0
        self.reserved: Request | None = None
        self.claim: Claim | None = None
        self._doom_at = -1
        self.slots_valid = 0  # for tests and statistics
        self.slots_invalid = 0
        self.flag_rounds = 0  # slots whose first value came out NaN: flags decided
        self.backup_bytes = 0  # copied at claims, to restore a lost slot from
        self._backup: torch.Tensor | None = None  # bytes; see _backup_of
        self._first_backup: dict[torch.dtype, torch.Tensor] = {}  # 2 ranks: one value each
        self._sum = group_ops.PreparedSum(group)  # the options built once, not per op
        # The reservation as the caller's arguments spell it (repeat_of), and how its slots
        # keep the tensor (_Plan): both worked out once, when the lane opens.
        self._repeat: _Repeat | None = None

    def status(self) -> Status:
        with self._lock:
            c = self.claim
            return Status(self.slot, c is not None, c is not None and c.name is None, self.open)

    @property
    def open(self) -> bool:
        return self.reserved is not None

    # ---- claiming ----------------------------------------------------------------------------

    def try_claim(
        self, request: Request, tensors: list[torch.Tensor], outputs: list[torch.Tensor] | None
    ) -> Claim | None:
        """Claim the current slot for ``request`` if it is the reservation; None otherwise.
        A request that matches but whose tensors cannot ride claims a dummy (so the peers do
        not wait for it) and returns None: it is negotiated instead."""
        with self._lock:
            reserved = self.reserved
            if reserved is None or self.claim is not None:
                return None
            if request is not reserved and request != reserved:
                return None
            if self._doom_at == self.slot:
                return None
            t = tensors[0] if len(tensors) == 1 else None
            out = outputs[0] if outputs else t
            if not _fits(t, out):
                self._claim_dummy()
                return None
            assert t is not None and out is not None
            # Contiguous (_fits): the first value is at the tensor's own storage offset, and
            # as_strided makes that view in one torch call where view(-1)[:1] takes two.
            first = out.as_strided((1,), (1,))
            plan = self._plan()
            if out is not t:
                copies.copy_(out, t)
                restore = None  # the op's own output: a lost slot is simply filled again
            elif plan is not _Plan.RING:
                restore = None  # the tensor changes only once the slot is surely valid
            elif self.size > 2:  # the real claimants' partial sums would remain
                restore = self._backup_of(out.view(-1))
            else:  # two ranks: only the first value can change (to NaN)
                restore = self._backup_of_first(first)
            self.claim = self._launch(reserved, reserved.name, out, first, plan, restore)
            return self.claim

    def repeat_of(
        self, name: str, t: torch.Tensor, op: str, prescale: float, postscale: float
    ) -> Request | None:
        """The reserved request, if an allreduce of ``t`` with these arguments submits exactly
        it; else None. Compares the arguments with the reservation field by field, so that a
        repeated op needs no request of its own (the caller's Python per op, issue 38)."""
        r = self._repeat  # one read: the controller may give the reservation up meanwhile
        if r is None or r.repeat is None or not r.repeat.matches(name, t, op, prescale, postscale):
            return None
        return r.repeat.request

    def _plan(self) -> _Plan:
        """How the reservation's slots run (worked out when the lane opened)."""
        assert self._repeat is not None  # set with the reservation, under the lock
        return self._repeat.plan

    def _backup_of(self, where: torch.Tensor) -> Callable[[], object]:
        """Keeps ``where`` in the lane's backup buffer, kept for the next claims (a fresh clone
        per op is a fresh allocation: an mmap, with its page faults, from 128 KiB on), and
        returns what puts it back. One claim at a time uses the buffer; a lost slot restores
        from it before the lane can reopen."""
        nbytes = where.numel() * where.element_size()
        self.backup_bytes += nbytes
        if self._backup is None or self._backup.numel() < nbytes:
            self._backup = torch.empty(nbytes, dtype=torch.uint8)
        backup = self._backup[:nbytes].view(where.dtype)
        copies.copy_(backup, where)
        return functools.partial(copies.copy_, where, backup)

    def _backup_of_first(self, first: torch.Tensor) -> Callable[[], object]:
        """What puts one value back: a Python float holds every floating value exactly, so
        that needs no copy in torch; only a NaN's payload keeps a one-value copy (per dtype)."""
        value = first.item()
        if value == value:
            return functools.partial(first.fill_, value)
        backup = self._first_backup.get(first.dtype)
        if backup is None:
            backup = self._first_backup[first.dtype] = torch.empty(1, dtype=first.dtype)
        backup.copy_(first)
        return functools.partial(first.copy_, backup)

    def _claim_dummy(self) -> None:
        req = self.reserved
        assert req is not None and self.claim is None
        meta = req.tensors[0]
        dtype = dtypes.from_name(meta.dtype)
        plan = self._plan()
        if plan is _Plan.AGREED:
            nothing = torch.empty(0, dtype=dtype)  # its slot moves no data
            self.claim = self._launch(req, None, nothing, nothing, plan)
            return
        data = torch.full(meta.shape, -0.0, dtype=dtype)
        flat = data.view(-1)
        # Marks the slot: every rank's first value comes out NaN; for a rank-ordered sum, every
        # rank's chunk starts with NaN too, so that each sees one among its rows' first values
        # (ordered.OrderedWork's landing). Elsewhere only the first value may change: a real
        # claimant restores that one value (2 ranks).
        marks = ordered.chunk_starts(flat.numel(), self.size) if plan is _Plan.ASIDE else [0]
        flat[marks] = math.nan
        self.claim = self._launch(req, None, data, flat[:1], plan)

    def _launch(
        self,
        req: Request,
        name: str | None,
        data: torch.Tensor,
        first: torch.Tensor,
        plan: _Plan,
        restore: Callable[[], object] | None = None,
    ) -> Claim:
        """The claim, its collectives started last: a caller that waits next should block as
        soon as they are under way (Python run between Gloo's start and the wait costs Gloo's
        loop more spin than the same time before the start: docs/benchmarks/log/
        2026-11-29-lane-repeat.md)."""
        claim = Claim(self.slot, req, name, data, first, [], time.perf_counter(), restore)
        if plan is _Plan.AGREED:
            start = functools.partial(self._sum, data)
            claim.agreed = agreed.AgreedWork(self.size, name is not None, start, self._sum)
            claim.works.append(claim.agreed)
        elif plan is _Plan.ASIDE:
            flat = data.view(-1)
            claim.ordered = ordered.OrderedWork(
                flat, "Sum", self._group, self._scratch, self._landing
            )
            claim.works.append(claim.ordered)
        else:
            claim.works.append(self._sum(data))
        return claim

    def doom(self, slot: int) -> None:
        """Claim ``slot`` as a dummy: now if it is the current, unclaimed slot of an open lane;
        when the lane reaches it, if it is ahead; never if this rank has claimed it already."""
        with self._lock:
            if slot > self.slot:
                self._doom_at = max(self._doom_at, slot)
            elif slot == self.slot and self.claim is None and self.reserved is not None:
                self._claim_dummy()

    def open_at(self, slot: int, request: Request) -> bool:
        """Reserve ``slot`` onwards for ``request`` (a decision every rank makes alike)."""
        with self._lock:
            if self.reserved is not None or self.claim is not None or self.slot != slot:
                return False  # cannot happen: every rank reported the lane closed at ``slot``
            self.reserved = request
            self._repeat = _Repeat.of(request, self.size, self._in_order)
            self._doom_at = -1
            return True

    # ---- settling ----------------------------------------------------------------------------

    def settle(self, claim: Claim | None = None) -> Claim | None:
        """Take the verdict of the current slot if its collectives are done. Returns the claim
        whose verdict this call took (exactly one caller gets each), else None: not done yet,
        or (first value NaN) the flags' allreduce was just started and must be waited for."""
        with self._lock:
            c = self.claim
            if c is None or (claim is not None and c is not claim) or not c.completed():
                return None
            try:
                for w in c.works:
                    w.wait()  # completed: raises the transport's error if there was one
                if c.agreed is not None:
                    return self._verdict(c, bool(c.agreed.valid))
                if c.flag is None:
                    first = c.first if c.ordered is None else c.ordered.result[:1]
                    if not math.isnan(first.item()):
                        return self._verdict(c, True)  # no dummy took part: valid
                    # A dummy, or NaN in the data itself: every rank saw the same NaN, and
                    # every rank now sends its flag (1: real) to tell the two apart.
                    self.flag_rounds += 1
                    c.flag = torch.tensor([0 if c.name is None else 1], dtype=torch.int32)
                    c.works = [group_ops.allreduce(c.flag, self._group, async_op=True)]
                    return None
                return self._verdict(c, int(c.flag.item()) == self.size)
            except Exception:
                self.claim, self.reserved, self._repeat = None, None, None
                raise

    def _verdict(self, c: Claim, valid: bool) -> Claim:
        c.valid = valid
        self.claim = None
        self.slot += 1
        if valid:
            self.slots_valid += 1
            if c.ordered is not None and c.ordered.landed and c.name is not None:
                copies.copy_(c.data.view(-1), c.ordered.result)  # the sum, from where it landed
        else:
            self.slots_invalid += 1
            self.reserved, self._repeat = None, None
            if c.restore is not None:
                # Now, under the lock: once the lane reopens, the next claim reuses the backup.
                c.restore()
                c.restore = None
        if self._doom_at == self.slot and self.reserved is not None:
            self._claim_dummy()
        return c

    def drain(self, timeout_s: float) -> list[Claim]:
        """At shutdown: see this rank's claims through, including a dummy decided for a slot
        ahead, so that no peer is left in a slot this rank never claims (a group cannot be
        destroyed with a collective in flight). Gives up after ``timeout_s`` (a peer failed).
        Returns the claims whose verdicts this call took (their ops are the caller's to end)."""
        deadline = time.monotonic() + timeout_s
        settled: list[Claim] = []
        while True:
            with self._lock:
                c = self.claim
            if c is None:
                return settled
            try:
                for w in list(c.works):
                    if not wait_for(w, deadline - time.monotonic()):
                        return settled
                if (verdict := self.settle(c)) is not None:
                    settled.append(verdict)
            except Exception:
                return settled  # a peer failed: its error is reported elsewhere


def wait_for(work: Any, seconds: float) -> bool:
    """Wait for ``work`` up to ``seconds``; False if it is still running (Gloo, and ringtrain's
    own groups, raise when a timed wait runs out, and the work can be waited on again)."""
    timeout = _NUDGE if seconds == NUDGE_S else datetime.timedelta(seconds=max(seconds, 0.001))
    try:
        work.wait(timeout=timeout)
    except RuntimeError:
        if not work.is_completed():
            return False
        # It ran out ("Operation timed out!"), then completed before is_completed() looked, or
        # it failed: an untimed wait tells the two apart (it raises the work's own error).
        work.wait()
    return True


def _fits(t: torch.Tensor | None, out: torch.Tensor | None) -> bool:
    """Whether a claim can reduce in ``out`` directly, as the normal path does."""
    if t is None or out is None or t.is_sparse or not t.is_cpu:  # is_cpu: no device object
        return False
    if out is t:  # in place: the usual case, one tensor to check
        return t.is_contiguous() and str(t.dtype) in _DTYPES
    return (
        out.is_contiguous()
        and out.dtype == t.dtype
        and out.shape == t.shape
        and out.is_cpu
        and str(t.dtype) in _DTYPES
    )
