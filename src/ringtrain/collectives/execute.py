"""Run ready collectives on the data groups: fusion, dtype adaptation, scaling, joined ranks.

The controller hands over requests that every rank agreed to run now, in the same order on every
rank. Consecutive allreduces with the same reduce op, dtype, device and scale factors are packed
into one buffer (tensor fusion) up to the fusion threshold, because one large Gloo allreduce is far
cheaper than many small ones. Which async ops meet in one buffer depends on timing, and with
three or more ranks Gloo's ring sums an element in an order set by its offset in the buffer; so
with ``Config.reproducible`` (the default) and three or more ranks, floating-point sums and
products run through :mod:`~ringtrain.collectives.ordered` instead, which adds every element in
rank order wherever it lies: they fuse as freely as at two ranks (which sum ``a + b``, the same
either way round) and keep their bits. A small allreduce that could not travel inline is reduced
as inline ones are (every rank's values, in rank order), so that the round it fell into cannot
change it either. Packing, unpacking and scaling run on this thread alone
(:mod:`~ringtrain.collectives.copies`). The other kinds run one request at a time
(:mod:`ringtrain.collectives.unfused`); scale factors and Average are :mod:`~ringtrain.collectives.scaling`.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ringtrain.collectives import copies, dtypes, inline, ordered, unfused
from ringtrain.collectives.handles import Handle
from ringtrain.collectives.inline import INLINE_MAX_BYTES as INLINE_MAX
from ringtrain.collectives.requests import Request, lowest
from ringtrain.collectives.scaling import REDUCE_OPS, scaling_of
from ringtrain.compression.averaging import Factors
from ringtrain.config import Config
from ringtrain.diagnostics import timeline
from ringtrain.errors import (
    CollectiveAbortedError,
    CollectiveArgumentError,
    CollectiveError,
    SecurityError,
)
from ringtrain.runtime.communicator import Communicator
from ringtrain.transport import group_ops

# Fused allreduces move in chunks of this size, pipelined with packing and unpacking. Large
# enough that Gloo's per-op cost (about a millisecond) stays small next to the transfer.
PIPELINE_CHUNK_BYTES = 16 * 1024 * 1024
# Layouts of the fusion buffer kept (see Executor._shaped): a program repeats a few bursts.
KEPT_LAYOUTS = 8


@dataclass
class Pending:
    """A collective this rank submitted: its request, tensors and the handle to complete."""

    request: Request
    tensors: list[torch.Tensor]
    outputs: list[torch.Tensor] | None
    handle: Handle
    # The request's number in the controller's request cache when submitted, else -1 (looked
    # up on the submitting thread: the controller's round then need not hash the request).
    cache_id: int = -1


@dataclass
class _Item:
    name: str
    request: Request
    tensors: list[torch.Tensor]
    outputs: list[torch.Tensor]
    handle: Handle | None  # None on a joined rank standing in with zeros
    contributors: int


class Executor:
    """Executes ready collectives for one process set, batching fusable allreduces."""

    def __init__(self, comm: Communicator, config: Config) -> None:
        self.comm = comm
        self.threshold = config.fusion_threshold_bytes
        # Whether arrival decides what is summed in which order (see the module docstring).
        self.order_free = not config.reproducible or comm.size <= 2
        self._scratch = ordered.Scratch()
        self._batch: list[_Item] = []
        self._batch_key: tuple[Any, ...] | None = None
        self._batch_bytes = 0
        self._batch_alone = False  # the batch holds an op that shares no buffer
        self._small: list[_Item] = []  # small allreduces of 3+ ranks, gathered at the flush
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._layouts: dict[tuple[Any, ...], list[torch.Tensor]] = {}  # see _shaped
        self.inline_ops = 0  # ops whose data came with the negotiation, for tests and stats
        self.fused_ops = 0  # fused allreduces run (one per batch, however many chunks)
        self.gathered_ops = 0  # allgathers that carried small allreduces (3+ ranks)

    def add(
        self,
        name: str,
        by_rank: Mapping[int, Request],
        local: Pending | None,
        joined: frozenset[int],
        me: int,
        inline_data: Mapping[int, inline.Payload] | None = None,
    ) -> None:
        """Run (or batch) one ready collective. ``inline_data``: every submitting rank's data
        of a small allreduce, which then reduces here without a collective of its own."""
        req = lowest(by_rank)
        if local is None:  # this rank has joined: contribute zeros shaped like the others' tensors
            tensors = [unfused.zeros(m) for m in req.tensors]
            outputs: list[torch.Tensor] = list(tensors)
            handle = None
        else:
            tensors, outputs, handle = local.tensors, local.outputs or [], local.handle
        started = time.perf_counter()
        try:
            if joined:
                self._check_joined(req, joined)
            if req.kind == "allreduce":
                # Joined ranks contribute zeros and Average divides by the whole set, as Horovod.
                item = _Item(name, req, tensors, outputs, handle, self.comm.size)
                if inline_data is None:
                    facts = req.derived("fusion", _facts)
                    if not self.order_free and facts.on_cpu and 0 < facts.nbytes <= INLINE_MAX:
                        self._small.append(item)  # with the round's other small ones
                    else:
                        self._queue_allreduce(item, facts)
                    return
                result = self._inline_allreduce(item, inline_data)
            else:
                self.flush()
                result = self._run_one(req, by_rank, tensors, outputs, me, inline_data)
            what = req.kind.upper()
            if inline_data is not None:
                what += " (inline)"
                self.inline_ops += 1
            self._record(what, started, [name])
        except CollectiveError as e:
            self.flush()
            if handle is not None:
                handle.set_error(e)
            return
        except Exception as e:  # the transport failed: this op's caller must not wait forever
            if handle is not None:
                handle.set_error(transport_error(e))
            raise  # and the controller fails everything else
        if handle is not None:
            handle.set_result(result)

    def _check_joined(self, req: Request, joined: frozenset[int]) -> None:
        """While ranks have joined, only allreduce (Sum or Average: the joined ranks add zeros)
        and barrier run. Horovod refuses allgather, broadcast, alltoall and reducescatter then;
        Min, Max and Product would take the zeros for data, so they are refused too."""
        who = sorted(self.comm.ranks[r] for r in joined)
        hint = (
            "HINT: while some ranks have called join(), the others may only run allreduces "
            "(Sum or Average) and barriers, as in Horovod; run the rest before join()."
        )
        if req.kind not in ("allreduce", "barrier"):
            raise CollectiveArgumentError(
                f"{req.kind} {req.name!r} is not supported while ranks {who} have joined.\n{hint}"
            )
        if req.kind == "allreduce" and req.op not in ("Sum", "Average"):
            raise CollectiveArgumentError(
                f"allreduce {req.name!r} with op={req.op} cannot run while ranks {who} have "
                f"joined: their zeros would enter the {req.op}.\n{hint}"
            )

    # ---- allreduce with fusion ---------------------------------------------------------------

    def _queue_allreduce(self, item: _Item, facts: _Facts) -> None:
        key = (facts.key, item.contributors)
        alone = not self._fuses_freely(facts)
        if self._batch and (
            key != self._batch_key
            or self._batch_bytes + facts.nbytes > self.threshold
            or alone
            or self._batch_alone
        ):
            self.flush()
        self._batch.append(item)
        self._batch_key = key
        self._batch_bytes += facts.nbytes
        self._batch_alone = alone

    def _fuses_freely(self, facts: _Facts) -> bool:
        """Whether an op may share a buffer with ops that arrived with it, its bits the same:
        at two ranks, when reproducibility was waived, for reductions exact in any order, and
        in host memory up to :data:`~ringtrain.collectives.ordered.ALONE_ABOVE_BYTES` (summed
        in rank order). Device tensors on 3+ ranks, reproducibly, still go one request per
        buffer (NCCL's ring orders a sum by offset, as Gloo's does), and so do larger ops,
        on Gloo's ring."""
        if self.order_free or facts.dtype is None:
            return True
        if not ordered.needed(facts.key[0], facts.dtype, self.comm.size):
            return True
        return facts.first_on_cpu and not ordered.alone(facts.nbytes)

    def flush(self) -> None:
        """Run the allreduces batched so far: the fused batch, then the small ones gathered."""
        self._flush_fused()
        self._flush_small()

    def _flush_fused(self) -> None:
        batch, self._batch, self._batch_bytes, self._batch_key = self._batch, [], 0, None
        self._batch_alone = False
        if batch:
            started = time.perf_counter()
            self._settle(batch, functools.partial(self._fused_allreduce, batch))
            self._record("ALLREDUCE", started, [item.name for item in batch])

    def _record(self, what: str, started: float, names: list[str]) -> None:
        rec = timeline.current()
        if rec.enabled:
            rec.span(
                f"collectives set {self.comm.set_id}",
                what,
                started,
                time.perf_counter(),
                {"tensors": names[:16], "count": len(names)},
            )

    def _inline_allreduce(
        self, item: _Item, payloads: Mapping[int, inline.Payload]
    ) -> list[torch.Tensor]:
        work = dtypes.to_reducible_all(item.tensors, item.request.op)
        scaling = scaling_of(item.request, item.contributors, work[0].dtype)
        flat = inline.reduce(item.name, payloads, item.request.op, scaling.before)
        numels = [w.numel() for w in work]
        plain = _all_reducible_in(item.outputs, work)
        self._unpack(flat, None, item.outputs, _cut(flat, work, numels), plain, scaling)
        return item.outputs

    def _flush_small(self) -> None:
        """The small allreduces of 3+ ranks that did not travel inline (vector rounds carry no
        data; a gathered round's message may be full): every rank's values of all of them in
        one allgather per dtype, each op then reduced in rank order from its own columns,
        exactly as inline, so its result does not depend on which round it fell into or
        which ops came with it."""
        items, self._small = self._small, []
        groups: dict[torch.dtype, list[tuple[_Item, list[torch.Tensor]]]] = {}
        for item in items:
            work = dtypes.to_reducible_all(item.tensors, item.request.op)
            if any(w.dtype != work[0].dtype for w in work):  # one path whatever the timing
                self._settle([item], functools.partial(self._fused_allreduce, [item]))
            else:
                groups.setdefault(work[0].dtype, []).append((item, work))
        for members in groups.values():
            started = time.perf_counter()
            run = functools.partial(self._gather_small, members)
            self._settle([item for item, _ in members], run)
            self._record("ALLREDUCE", started, [item.name for item, _ in members])

    def _settle(self, items: list[_Item], run: Callable[[], None]) -> None:
        """Run ``run()`` and complete ``items``' handles with its outcome."""
        try:
            run()
        except CollectiveAbortedError as e:  # a peer failed, or a newer world was announced
            for item in items:
                if item.handle is not None:
                    item.handle.set_error(e)
            raise  # the controller too: its peers are gone
        except CollectiveError as e:
            for item in items:
                if item.handle is not None:
                    item.handle.set_error(e)
            return
        except Exception as e:  # the transport failed: fail these, then the controller
            for item in items:
                if item.handle is not None:
                    item.handle.set_error(transport_error(e))
            raise
        for item in items:
            if item.handle is not None:
                item.handle.set_result(item.outputs)

    def _gather_small(self, members: list[tuple[_Item, list[torch.Tensor]]]) -> None:
        flat = torch.cat([w.reshape(-1) for _, work in members for w in work])
        rows = torch.empty(self.comm.size * flat.numel(), dtype=flat.dtype)
        group_ops.all_gather_into(rows, flat, self.comm.group_for(flat))
        self.gathered_ops += 1
        stack, offset = rows.view(self.comm.size, -1), 0
        for item, work in members:
            numels = [w.numel() for w in work]
            part = stack[:, offset : offset + sum(numels)].contiguous()  # this op's columns
            offset += sum(numels)
            scaling = scaling_of(item.request, item.contributors, work[0].dtype)
            scaling.before(part)
            out = inline.reduce_rows(part, item.request.op)
            plain = _all_reducible_in(item.outputs, work)
            self._unpack(out, None, item.outputs, _cut(out, work, numels), plain, scaling)

    def _fused_allreduce(self, batch: list[_Item]) -> None:
        tensors = [t for item in batch for t in item.tensors]
        outputs = [o for item in batch for o in item.outputs]
        if not tensors:
            return
        work = dtypes.to_reducible_all(tensors, batch[0].request.op)
        if len({w.dtype for w in work}) == 1:  # the common case (a grouped call's 1,000s too)
            self._reduce_fused(batch, tensors, work, outputs)
            return
        # A grouped allreduce over several dtypes: each reduced in its own, in the order they
        # first come (alike on every rank), as Horovod fuses only tensors of one dtype.
        for kind in dict.fromkeys(w.dtype for w in work):
            mine = [i for i, w in enumerate(work) if w.dtype == kind]
            parts = [tensors[i] for i in mine], [work[i] for i in mine], [outputs[i] for i in mine]
            self._reduce_fused(batch, *parts)

    def _reduce_fused(
        self,
        batch: list[_Item],
        tensors: list[torch.Tensor],
        work: list[torch.Tensor],
        outputs: list[torch.Tensor],
    ) -> None:
        """Allreduce ``tensors`` (``work``: as reduced, one dtype) into ``outputs`` in one
        fused op."""
        req = batch[0].request
        op = req.op
        self.fused_ops += 1
        scaling = scaling_of(req, batch[0].contributors, work[0].dtype)
        group = self.comm.group_for(work[0])
        # Reproducible from three ranks: floating-point sums in rank order, so that no element's
        # bits depend on where it lies in the buffer (ringtrain.collectives.ordered).
        in_order = (
            not self.order_free
            and work[0].device.type == "cpu"
            and ordered.needed(op, work[0].dtype, self.comm.size)
            and not (len(batch) == 1 and ordered.alone(sum(t.nbytes for t in tensors)))
        )
        flat = one_block(outputs, work)  # in place, back to back: reduce them where they lie
        if flat is None and len(work) == 1 and _reducible_in(outputs[0], work[0]):
            flat = outputs[0]  # one tensor: reduce in its output, no packing
            if flat.data_ptr() != work[0].data_ptr():
                copies.copy_(flat, work[0])
        if flat is not None:
            copies.scale_(flat, scaling.pre)
            if in_order:
                ordered.allreduce(flat.view(-1), op, group, self._scratch)
            elif self.comm.size > 1:
                group_ops.allreduce(flat, group, REDUCE_OPS[op])
            copies.scale_(flat, scaling.post)
            return
        # Pack, reduce and unpack in chunks, pipelined: while Gloo moves one chunk, this thread
        # packs the next and unpacks the previous, so the copies hide behind the transfer.
        # Per-tensor facts are read once per batch: a grouped call may hold a thousand tensors.
        # Every copy and scaling runs on this thread alone (:mod:`~ringtrain.collectives.copies`).
        numels = [w.numel() for w in work]
        buf = self._fusion_buffer(work[0], sum(numels))
        shaped = self._shaped(buf, work, numels)
        plain = _all_reducible_in(outputs, work)
        in_flight: collections.deque[
            tuple[torch.Tensor, Any, list[torch.Tensor], list[torch.Tensor]]
        ] = collections.deque()
        offset = 0
        for chunk in _chunks(numels, PIPELINE_CHUNK_BYTES // buf.element_size()):
            k = sum(numels[chunk.start : chunk.stop])
            flat = buf[offset : offset + k]
            offset += k
            pieces = shaped[chunk.start : chunk.stop]
            copies.copy_all_(pieces, work[chunk.start : chunk.stop])
            copies.scale_(flat, scaling.pre)
            pending = None
            if in_order:  # one at a time: the chunks share the scratch
                ordered.allreduce(flat, op, group, self._scratch)
            elif self.comm.size > 1:
                pending = group_ops.allreduce(flat, group, REDUCE_OPS[op], async_op=True)
            in_flight.append((flat, pending, outputs[chunk.start : chunk.stop], pieces))
            if len(in_flight) > 1:
                self._unpack(*in_flight.popleft(), plain, scaling)
        while in_flight:
            self._unpack(*in_flight.popleft(), plain, scaling)

    @staticmethod
    def _unpack(
        flat: torch.Tensor,
        pending: Any,
        outputs: list[torch.Tensor],
        pieces: list[torch.Tensor],
        plain: bool,
        scaling: Factors,
    ) -> None:
        """``flat``'s reduced values into ``outputs``, through ``pieces``: views of ``flat``
        shaped like them."""
        if pending is not None:
            group_ops.finish(pending, flat)
        copies.scale_(flat, scaling.post)
        if plain:  # the common case, in one call: no per-tensor overhead
            copies.copy_all_(outputs, pieces)
            return
        for out, piece in zip(outputs, pieces):
            copies.copy_(out, piece.view(torch.uint64) if out.dtype == torch.uint64 else piece)

    def _shaped(
        self, buf: torch.Tensor, work: list[torch.Tensor], numels: list[int]
    ) -> list[torch.Tensor]:
        """``buf`` cut into views shaped like ``work``'s tensors, back to back. Kept by layout
        for the executor's own buffer: a program repeats its bursts, and making two views per
        tensor per batch was a tenth of the controller's time in a burst of 256 (issue 38)."""
        kept = self._buffers.get((buf.dtype, buf.device))
        if kept is None or kept.data_ptr() != buf.data_ptr():
            return _cut(buf, work, numels)  # a buffer of its own: not kept, nor its views
        key = (buf.device, buf.data_ptr(), buf.dtype, tuple(w.shape for w in work))
        views = self._layouts.get(key)
        if views is None:
            if len(self._layouts) >= KEPT_LAYOUTS:
                self._layouts.clear()
            views = self._layouts[key] = _cut(buf, work, numels)
        return views

    def _fusion_buffer(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        """``numel`` elements of this executor's fusion buffer for ``like``'s dtype and device.

        The buffer lives as long as the executor: a fresh tensor of tens of MiB is a fresh mmap
        whose page faults cost several times the copy itself (Horovod keeps one for that reason).
        Safe to reuse: a batch is unpacked into its outputs before the next is packed. A
        grouped op larger than the fusion threshold gets a buffer of its own, not kept.
        """
        key = (like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            if numel * buf.element_size() <= max(self.threshold, 1 << 20):
                self._buffers[key] = buf
                self._layouts.clear()  # views of the buffer this one replaces
        return buf[:numel]

    # ---- everything else ---------------------------------------------------------------------

    def _run_one(
        self,
        req: Request,
        by_rank: Mapping[int, Request],
        tensors: list[torch.Tensor],
        outputs: list[torch.Tensor],
        me: int,
        inline_data: Mapping[int, inline.Payload] | None = None,
    ) -> Any:
        if req.kind == "barrier":
            return None
        if req.kind == "broadcast":
            root = self.comm.ranks.index(req.root)  # roots are global ranks, as in Horovod
            root_data = inline_data[root] if inline_data is not None else None
            return unfused.broadcast(self.comm, req, by_rank, tensors, outputs, root, me, root_data)
        if req.kind == "allgather":
            pieces = None
            if inline_data is not None:
                pieces = inline.split(
                    req.name, inline_data, {r: q.tensors for r, q in by_rank.items()}
                )
            return [
                unfused.allgather(self.comm, i, t, by_rank, pieces) for i, t in enumerate(tensors)
            ]
        if req.kind == "reducescatter":
            return [unfused.reducescatter(self.comm, req, t) for t in tensors]
        if req.kind == "alltoall":
            return unfused.alltoall(self.comm, by_rank, tensors[0], me)
        raise CollectiveArgumentError(f"unknown collective kind {req.kind!r}")


class _Facts(NamedTuple):
    """What fusion asks of an allreduce's tensors, read from its request once per request
    object (a repeated op submits the same one: issue 38, the controller's Python per op)."""

    key: tuple[Any, ...]  # op, dtype, device, prescale, postscale: what a batch shares
    nbytes: int
    dtype: torch.dtype | None  # the first tensor's (None: no tensors)
    first_on_cpu: bool
    on_cpu: bool  # every tensor's


def _facts(req: Request) -> _Facts:
    metas = req.tensors
    first = metas[0] if metas else None
    key = (
        req.op,
        first.dtype if first else None,
        first.device if first else None,
        req.prescale,
        req.postscale,
    )
    nbytes = dtypes.nbytes_of(metas)
    dtype = dtypes.from_name(first.dtype) if first else None
    on_cpu = all(m.device == "cpu" for m in metas)
    return _Facts(key, nbytes, dtype, first is not None and first.device == "cpu", on_cpu)


def transport_error(e: Exception) -> Exception:
    """What the callers of an op see when its transport fails: a SecurityError as it is (it names
    the peer), anything else as the peer failure it almost always is."""
    if isinstance(e, SecurityError):
        return e
    return CollectiveAbortedError(
        f"a collective failed in transit: a peer rank failed or became unreachable "
        f"({type(e).__name__}: {str(e).strip()[:300]}).\n"
        "HINT: the launcher's message names the rank that failed first."
    )


def _chunks(numels: list[int], chunk_numel: int) -> list[range]:
    """Consecutive runs of tensors (by index) of about ``chunk_numel`` elements, whole tensors."""
    chunks: list[range] = []
    start, size = 0, 0
    for i, k in enumerate(numels):
        if i > start and size >= chunk_numel:
            chunks.append(range(start, i))
            start, size = i, 0
        size += k
    chunks.append(range(start, len(numels)))
    return chunks


def _cut(flat: torch.Tensor, work: list[torch.Tensor], numels: list[int]) -> list[torch.Tensor]:
    """``flat`` as views shaped like ``work``'s tensors (of ``numels`` elements), back to back."""
    return [p.view(w.shape) for p, w in zip(flat.split_with_sizes(numels), work)]


def one_block(outputs: list[torch.Tensor], work: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one flat tensor, if the op is in place and they lie back to back, in
    order, in one storage (views of a flat buffer, as fused gradients often are): then they are
    reduced where they lie, with no packing and no copy back. None otherwise."""
    first = work[0]
    storage = first.untyped_storage().data_ptr()
    size = first.element_size()
    at, total = first.data_ptr(), 0
    for out, w in zip(outputs, work):
        if (
            out is not w
            or w.dtype != first.dtype
            or w.numel() == 0
            or not w.is_contiguous()
            or w.data_ptr() != at
            or w.untyped_storage().data_ptr() != storage
        ):
            return None
        at += w.numel() * size
        total += w.numel()
    whole = torch.empty(0, dtype=first.dtype, device=first.device)
    return whole.set_(first.untyped_storage(), first.storage_offset(), (total,), (1,))


def _all_reducible_in(outputs: list[torch.Tensor], work: list[torch.Tensor]) -> bool:
    """Whether every output can take its reduced piece as it is (one ``_foreach_copy_``)."""
    return all(o.is_contiguous() and (o is w or _reducible_in(o, w)) for o, w in zip(outputs, work))


def _reducible_in(out: torch.Tensor, work: torch.Tensor) -> bool:
    """Whether ``work`` can be reduced in ``out`` itself: same dtype (so no conversion is
    pending) and one dense block of memory that Gloo can address."""
    return out.dtype == work.dtype and out.shape == work.shape and out.is_contiguous()
