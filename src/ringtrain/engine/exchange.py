"""Run a bucket plan: pack gradients, launch each bucket's allreduce, unpack the averages.

One :class:`GradientExchange` serves one plan. Gradient hooks call :meth:`ready`; when a bucket's
last gradient arrives, that bucket and every complete bucket after it (in plan order, never out
of it) is packed into its flat buffer and launched through the stream's :mod:`ringtrain.transport`
(``allreduce``: the group's own, issued from this thread) on the process set's dedicated
``engine`` Gloo group. No negotiation happens: every rank holds the same plan and
launches the same buckets in the same order, which is all Gloo needs to match them. A bucket
waiting for a gradient this rank never computes waits for :meth:`flush` (called by ``step()``),
which launches what is left with zeros in place of missing gradients, then the sparse gradients.
:meth:`finish` waits for each bucket in order.

Gradients live in their buckets (DDP's ``gradient_as_bucket_view``). When a gradient is ready it
is copied into its place in the bucket's flat buffer, scaled on the way (the average's division
costs no pass of its own), and ``.grad`` becomes that view; a gradient that already is the view
(``zero_grad(set_to_none=False)``, accumulation) is scaled where it lies. The allreduce's result
is then the gradient: nothing is copied back. Next to packing into a scratch buffer and copying
out, that is one pass over every gradient less per step, and one copy of the gradients less in
memory. So after ``step()`` a ``.grad`` is a view into a buffer the next step reuses; clone it to
keep it.

The codec owns the bytes (:class:`ringtrain.compression.codec.Wire`): each bucket's wire, made
once by the codec over the flat buffer, encodes it for the transport (fp16/bf16: a cast into a
wire buffer kept across steps), decodes the reduced sum back into the flat buffer (scaled on the
way), and declares whether a sum holding inf or nan is redone in full precision. The exchange
knows buckets and streams, not dtypes.

Numerics. Averaging is a sum with scale factors: ``pre`` before the sum, ``post`` after. The
whole division by the world size happens *before* the sum (unless ``gradient_predivide_factor``
splits it), as in DDP: so with a 16-bit wire (fp16, bf16) the sum is already an average and
cannot overflow unless a single averaged value does; and if it does anyway (a result holds inf
or nan) and the wire declares the fallback, that bucket is reduced again in full precision
(:func:`ringtrain.compression.overflow.redo_if_not_finite`), which every rank decides alike
because allreduce results are identical on every rank. Sparse gradients are allgathered
(indices and values, padded to the largest count) and summed locally; they are never compressed.

Stateful reducers (PowerSGD, top-k: :class:`ringtrain.compression.base.GradientReducer`) issue
their own blocking collectives; they run on one worker thread, bucket after bucket in plan
order, so they overlap backward and keep the same collective order on every rank.

Reduce-scatter (``scatter=True``, with the sharded step: :mod:`ringtrain.engine.sharded`). Each
bucket (and its wire's kept buffer) is cut into the sharded step's N shards and reduce-scattered
through the stream's :mod:`ringtrain.transport` (a ring over a Gloo group on its worker, the sealed
or tcp group's own ring, NCCL): rank r receives the sum of shard r only, so (N-1)/N of the bucket
leaves each rank instead of an allreduce's 2(N-1)/N, and the sharded step's all-gather of the
parameters brings the total back to an allreduce's. Where the wire declares the fallback, a
shard that overflowed on any rank makes every rank reduce-scatter the bucket again in full
precision, inside the same operation. Reducers (PowerSGD, top-k), custom codecs (a wire without
a kept buffer cannot be cut) and the hierarchical allreduce reduce whole buckets:
the sharded step takes its shard after. The sums follow the ring's order (fixed by rank, not by
timing or layout). Outside its own shard, a rank's ``.grad`` keeps its own (scaled) gradient
until :meth:`GradientExchange.gather_grads` all-gathers the reduced shards.

Streams (:mod:`ringtrain.engine.streams`). Bucket ``i`` travels on stream ``i % len(streams)``:
its own process group, so consecutive buckets are in flight at once. A stream's buckets go to
its transport, ``transport.of(route.group, route.hierarchical)``: the group's own, or, when the
stream has a hierarchical allreduce, that (blocking) algorithm as a transport on the stream's
worker thread (:class:`ringtrain.transport.base.HierarchicalTransport`), which cannot cut a
bucket into shards. ``_launch`` has one door per kind of codec: a summed codec's wire to the
stream's transport (``allreduce``, or ``reduce_scatter`` of its shards), a codec with rounds of
its own to those rounds, on the stream's worker. Every stream has at most one worker, which
runs its buckets in plan order: per group, the order of collectives is the plan's on every rank.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from ringtrain import transport
from ringtrain.compression import overflow
from ringtrain.compression.codec import Rounds, RoundsCodec, SummedCodec, Wire, as_codec
from ringtrain.compression.codec import scaled_into as codec_scaled_into
from ringtrain.diagnostics import timeline
from ringtrain.engine import sparse
from ringtrain.engine.buckets import Bucket, Plan
from ringtrain.engine.streams import Route
from ringtrain.engine.weighting import Averaging
from ringtrain.errors import InternalError
from ringtrain.runtime import abort
from ringtrain.transport import group_ops

_now = time.perf_counter


@dataclass
class _Times:
    """When a bucket's first and last gradients came, it was packed, sent, and done."""

    first: float = 0.0
    last: float = 0.0
    pack: float = 0.0
    sent: float = 0.0
    done: float = 0.0


class _Slot:
    """One bucket's buffers and per-step state."""

    def __init__(
        self,
        bucket: Bucket,
        params: Sequence[torch.nn.Parameter],
        summed: SummedCodec | None,
        scaling: Averaging,
    ) -> None:
        self.bucket = bucket
        first = params[bucket.params[0]]
        self.flat = torch.zeros(bucket.numel, dtype=first.dtype, device=first.device)
        self.members = [params[i] for i in bucket.params]
        # What each member's .grad becomes: its place in the flat buffer.
        self.views = [
            self.flat[o : o + _numel(s)].view(s) for o, s in zip(bucket.offsets, bucket.shapes)
        ]
        # The codec's way onto the wire and back (its encoding, its buffer kept across steps,
        # its overflow fallback); None: a codec with rounds of its own, which takes raw
        # gradients and returns averages.
        self.wire: Wire | None = None if summed is None else summed.wire(self.flat)
        # pre: applied as a gradient is placed in the bucket; post: to the result, in place.
        self.set_scaling(summed is None, scaling)
        self.stream = 0  # index of the stream (its Route) this bucket travels on
        self.chunks: list[torch.Tensor] = []  # reduce-scatter: the flat buffer's N shards
        self.wire_chunks: list[torch.Tensor] = []  # and the wire buffer's, cut alike
        self.reset()

    def set_scaling(self, own_rounds: bool, scaling: Averaging) -> None:
        """``pre``/``post`` for ``scaling`` (batch_shares may change them between steps)."""
        self.pre, self.post = scaling.codec_factors() if own_rounds else scaling.factors()

    def reset(self) -> None:
        self.missing = len(self.members)
        self.placed = [False] * len(self.members)
        self.launched = False
        self.work: Any = None
        self.sent: torch.Tensor | None = None  # what the wire's encode gave this step
        self.t = _Times()
        self.done: list[float] = []  # completion time, appended by a communication thread


def _place(slot: _Slot, pos: int) -> None:
    """Member ``pos``'s gradient into its view of the bucket, scaled by ``pre``; ``.grad``
    becomes the view. A gradient that already is the view is scaled where it lies."""
    p, view = slot.members[pos], slot.views[pos]
    g = p.grad
    if g is None:
        view.zero_()
    elif _is_view(g, view):
        if slot.pre != 1.0:
            view.mul_(slot.pre)
    else:
        if g.is_sparse:
            g = g.to_dense()
        if slot.pre != 1.0:
            torch.mul(g, slot.pre, out=view)  # scaled while copied: one pass, not two
        else:
            view.copy_(g)
    p.grad = view
    slot.placed[pos] = True


def _is_view(g: torch.Tensor, view: torch.Tensor) -> bool:
    return g is view or (
        not g.is_sparse
        and g.data_ptr() == view.data_ptr()
        and g.shape == view.shape
        and g.stride() == view.stride()
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class GradientExchange:
    """Launches and completes the collectives of one plan on one process set's engine group."""

    def __init__(
        self,
        plan: Plan,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        routes: Sequence[Route] | Any,
        compressor: Any,
        scaling: Averaging,
        scatter: bool = False,
        scatter_groups: Sequence[Any] | None = None,
    ) -> None:
        self.plan = plan
        self._params = list(params)
        self._names = list(names)
        if not isinstance(routes, (list, tuple)):
            routes = [Route(routes)]  # one process group
        self._routes: list[Route] = list(routes)
        # How buckets travel (compression.codec): summed on the wire, or in the codec's rounds.
        codec = as_codec(compressor)
        self._summed = None if codec.own_rounds else cast(SummedCodec, codec)
        self._own_rounds = cast(RoundsCodec, codec) if codec.own_rounds else None
        self._scaling = scaling
        self._slots = [_Slot(b, self._params, self._summed, scaling) for b in plan.buckets]
        # Each parameter's bucket and position in it ((-1, -1): sparse).
        self._where = [(-1, -1)] * len(self._params)
        for s, slot in enumerate(self._slots):
            slot.stream = s % len(self._routes)
            for pos, i in enumerate(slot.bucket.params):
                self._where[i] = (s, pos)
        self._next = 0  # position in _order of the first bucket not launched yet
        self._order = list(range(len(self._slots)))  # launch order (overlap: see set_launch_order)
        self._lock = threading.Lock()
        self._sparse_work: list[Any] = []
        # Measuring (compression="auto"): note completion times, sum up time on the wire.
        self.measure = False
        self.last_comm_s = 0.0
        self._hierarchical = self._summed is not None and any(
            route.hierarchical is not None for route in self._routes
        )
        self._transports = self._make_transports(scatter, scatter_groups)
        self._workers: list[transport.Hold] = []
        # A codec with rounds of its own runs them on the stream's group, on its worker.
        self._rounds: list[Rounds] = []
        if self._own_rounds is not None:
            for b in plan.buckets:
                self._own_rounds.plan(b.key, b.shapes)
            self._rounds = [transport.rounds(route.group) for route in self._routes]
        if self._own_rounds is not None:
            used = min(len(self._routes), len(self._slots)) or 1
            for route in self._routes[:used]:
                # Released by close(), or when an optimizer dropped without remove_hooks() is.
                self._workers.append(transport.Hold(route.group))

    def _make_transports(
        self, scatter: bool, scatter_groups: Sequence[Any] | None
    ) -> list[transport.Transport]:
        """A transport per stream (the stream's group's, or its hierarchical allreduce's), for
        a summed codec's wires. Reduce-scatter: every bucket's shards (of its flat buffer and of
        its wire buffer) on the scatter groups, where the transports cut (the hierarchical
        allreduce does not) and every wire keeps a buffer (a custom codec's does not); else a
        bucket is reduced whole and the sharded step takes its shard after."""
        if self._summed is None:
            return []  # a codec with rounds of its own runs them on the streams' groups
        made = [transport.of(route.group, route.hierarchical) for route in self._routes]
        cut = (
            scatter
            and all(t.cuts for t in made)
            and all(s.wire is not None and s.wire.buffer is not None for s in self._slots)
        )
        if not cut:
            return made
        if scatter_groups:
            for t in made:
                t.close()
            made = [transport.of(g) for g in scatter_groups]
        n = made[0].size
        for slot in self._slots:
            assert slot.wire is not None and slot.wire.buffer is not None
            slot.chunks = _cut(slot.flat, n)
            slot.wire_chunks = _cut(slot.wire.buffer, n)
        return made

    @property
    def streams(self) -> int:
        return len(self._routes)

    @property
    def hierarchical(self) -> bool:
        """Whether buckets go through the hierarchical allreduce."""
        return self._hierarchical

    @property
    def scatters(self) -> bool:
        """Whether buckets are reduce-scattered (each rank receives its shard's sum only)."""
        return any(slot.chunks for slot in self._slots)

    def close(self) -> None:
        for t in self._transports:
            t.close()
        for hold in self._workers:
            hold.release()
        self._workers = []

    # ---- during backward ----------------------------------------------------------------------

    def ready(self, index: int) -> None:
        """Parameter ``index`` has its final gradient for this step (called from its hook)."""
        s, pos = self._where[index]
        if s < 0:
            return  # sparse: exchanged at flush
        with self._lock:
            slot = self._slots[s]
            now = _now()
            if slot.missing == len(slot.members):
                slot.t.first = now
            _place(slot, pos)
            slot.missing -= 1
            slot.t.last = now
            while (
                self._next < len(self._slots) and self._slots[self._order[self._next]].missing == 0
            ):
                self._launch(self._slots[self._order[self._next]])
                self._next += 1

    # ---- at step() ----------------------------------------------------------------------------

    def flush(self) -> None:
        """Launch every bucket not launched yet (missing gradients count as zeros), then the
        sparse gradients."""
        with self._lock:
            now = _now()
            while self._next < len(self._slots):
                slot = self._slots[self._order[self._next]]
                if slot.t.first == 0.0:
                    slot.t.first = now
                slot.t.last = now
                self._launch(slot)
                self._next += 1
        if self.plan.sparse:
            if self._workers:
                for slot in self._slots:  # the workers must finish before the main thread
                    slot.work.result()  # issues more collectives on the group
            before = self._scaling.sparse_factors()[0]
            self._sparse_work = sparse.launch(
                self.plan.sparse, self._params, self._routes[0].group, before
            )

    def finish(self, then: Callable[[int], None] | None = None) -> None:
        """Wait for every bucket in plan order and write the results into ``.grad``; ``then(s)``,
        if given, runs as soon as bucket ``s`` is done, while later buckets are still on the
        wire (the optimizer's update of the bucket, see ``DistributedOptimizer.step``)."""
        try:
            rec = timeline.current()
            for s, slot in enumerate(self._slots):
                self._finish(slot, rec)
                if then is not None:
                    then(s)
            if self.plan.sparse:
                after = self._scaling.sparse_factors()[1]
                sparse.finish(self.plan.sparse, self._params, self._sparse_work, after)
            if self.measure:
                self.last_comm_s = _busy_s([(s.t.sent, s.t.done) for s in self._slots])
        finally:
            self.reset()

    def gather_grads(self) -> None:
        """Reduce-scatter: all-gather every bucket's reduced shards, so every ``.grad`` holds the
        whole reduced gradient (what a user's ``synchronize()`` promises). (N-1)/N of the
        gradients more on the wire. On the streams' workers, as the rings: another optimizer's
        rings may still be queued there (see :class:`ringtrain.transport.workers.SharedWorkers`)."""
        if not self.scatters:
            return
        gathers = [
            self._transport(slot).allgather(slot.chunks) for slot in self._slots if slot.chunks
        ]
        for handle in gathers:
            handle.wait()

    def set_scaling(self, scaling: Averaging) -> None:
        """New scale factors (batch_shares changed), between steps: every slot idle."""
        self._scaling = scaling
        for slot in self._slots:
            slot.set_scaling(self._own_rounds is not None, scaling)

    def set_launch_order(self, order: Sequence[int]) -> None:
        """Launch buckets in ``order`` (a permutation of the plan's bucket indices, the same on
        every rank) instead of plan order: :mod:`ringtrain.engine.overlap` sends the buckets the
        next forward needs first. The buckets themselves, and so every sum, stay the plan's."""
        if sorted(order) != list(range(len(self._slots))):
            raise InternalError(f"launch order {list(order)} is not a permutation of the buckets")
        self._order = list(order)

    def _transport(self, slot: _Slot) -> transport.Transport:
        return self._transports[slot.stream % len(self._transports)]

    def members(self, s: int) -> list[torch.nn.Parameter]:
        """The parameters of bucket ``s``."""
        return list(self._slots[s].members)

    def finish_slot(self, s: int, redo_group: Any = None) -> None:
        """Wait for bucket ``s`` alone and write its result into ``.grad`` (overlap: called per
        bucket from the updater thread; :meth:`reset` after the last one). ``redo_group``: where
        a 16-bit bucket that overflowed is reduced again, a group only this thread uses (on the
        stream's group, the main thread may be launching another optimizer's buckets meanwhile, in
        an order that differs by rank)."""
        self._finish(self._slots[s], timeline.current(), redo_group)

    def reset(self) -> None:
        for slot in self._slots:
            slot.reset()
        self._next = 0
        self._sparse_work = []

    # ---- dense buckets ------------------------------------------------------------------------

    def _launch(self, slot: _Slot) -> None:
        slot.t.pack = _now()
        for pos, placed in enumerate(slot.placed):
            if not placed:  # no hook this step: whatever .grad holds (zeros if none) goes
                _place(slot, pos)
        if slot.wire is None:  # a codec with rounds of its own, on the stream's worker
            slot.t.sent = _now()
            work: Any = self._workers[slot.stream].submit(
                self._own_rounds_codec().reduce,
                slot.bucket.key,
                slot.flat,
                self._rounds[slot.stream],
            )
        else:
            wire = slot.wire
            slot.sent = sent = wire.encode()  # the codec writes its wire (a kept buffer if any)
            slot.t.sent = _now()
            if slot.chunks:  # the wire buffer's shards; the flat buffer's are the fallback's
                fallback = slot.chunks if wire.redo_in_full else None
                work = self._transport(slot).reduce_scatter(slot.wire_chunks, fallback)
            else:
                work = self._transport(slot).allreduce(sent)
        slot.work = work
        if timeline.current().enabled or self.measure:
            # A fresh list per launch: a late callback cannot leak into the next step.
            work.add_done_callback(functools.partial(_mark_done, slot.done))
        slot.launched = True

    def _own_rounds_codec(self) -> RoundsCodec:
        if self._own_rounds is None:
            raise InternalError("a bucket without a wire, but no codec with rounds of its own")
        return self._own_rounds

    def _finish(self, slot: _Slot, rec: timeline.NullRecorder, redo_group: Any = None) -> None:
        if not slot.launched:
            raise InternalError(f"{slot.bucket.key} was never launched before finish()")
        flat, wire, post = slot.flat, slot.wire, slot.post
        if wire is None:  # a codec with rounds of its own returned the average
            codec_scaled_into(abort.wait_future(slot.work), flat, post)
        elif slot.chunks:
            redone = slot.work.wait()  # True: the narrow sum overflowed, the full one was taken
            mine = slot.chunks[self._transport(slot).rank]
            if not redone:
                wire.decode_into(slot.wire_chunks[self._transport(slot).rank], mine)
            if post != 1.0:
                mine.mul_(post)  # this rank's shard is reduced in place; the rest stays its own
        else:
            slot.work.wait()
            sent = slot.sent
            assert sent is not None
            group = self._routes[slot.stream].group if redo_group is None else redo_group
            # The wire's declared fallback (compression.overflow): a narrow sum that overflowed
            # (or data holding inf/nan) is redone in full precision; every rank sees the same
            # sum, so decides alike on its own. The flat buffer still held this rank's scaled
            # gradients: only the wire was reduced.
            if wire.redo_in_full and overflow.redo_if_not_finite(
                sent, lambda: group_ops.allreduce(flat, group)
            ):
                codec_scaled_into(flat, flat, post)
            else:  # decoded into the flat buffer, scaled on the way: the gradients are its views
                wire.decode_into(sent, flat, post)
        t_wait = _now()
        slot.t.done = slot.done[0] if slot.done else t_wait
        for p, view in zip(slot.members, slot.views):
            if p.grad is not view:  # replaced since it was placed (or a 1-element bucket)
                p.grad = view
        if rec.enabled:
            self._record(slot, rec, t_wait, _now())

    def _record(self, slot: _Slot, rec: timeline.NullRecorder, t_wait: float, t_end: float) -> None:
        b = slot.bucket
        track = f"bucket {b.index:02d}"
        args = {
            "key": b.key,
            "tensors": len(b.params),
            "bytes": b.nbytes,
            "first": self._names[b.params[0]],
        }
        rec.span(track, "FILL", slot.t.first, slot.t.last, args)
        rec.span(track, "PACK", slot.t.pack, slot.t.sent)
        done = slot.done[0] if slot.done else t_wait
        wire = _wire_name(slot) + (", reduce-scatter" if slot.chunks else "")
        if self._hierarchical:
            wire += ", hierarchical"
        rec.span(track, "ALLREDUCE", slot.t.sent, done, {"wire": wire, "stream": slot.stream})
        rec.span(track, "UNPACK", max(done, t_wait), t_end)


def _cut(flat: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``flat``'s n shards, as the sharded step cuts them (``sharded.layouts``)."""
    shard = -(-flat.numel() // n)
    return [
        flat[min(r * shard, flat.numel()) : min((r + 1) * shard, flat.numel())] for r in range(n)
    ]


def _busy_s(spans: Sequence[tuple[float, float]]) -> float:
    """Seconds during which at least one of ``spans`` (start, end) was open."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _mark_done(marks: list[float], _future: Any = None) -> None:
    marks.append(_now())


def _wire_name(slot: _Slot) -> str:
    sent = slot.sent
    return str(sent.dtype).replace("torch.", "") if sent is not None else "reducer"
