"""The :class:`Transport` interface and its three implementations (see the package docstring)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import torch
import torch.distributed as dist

from ringtrain.compression import overflow
from ringtrain.runtime import abort
from ringtrain.runtime.contracts import Group
from ringtrain.transport import group_ops
from ringtrain.transport.hierarchical import HierarchicalAllreduce
from ringtrain.transport.ring import Plain, Ring
from ringtrain.transport.ring_group import RingProcessGroup
from ringtrain.transport.workers import WORKERS, Hold


class InFlight(Protocol):
    """An operation under way."""

    def wait(self) -> object:
        """Block until done; returns the operation's result, raises its error."""
        ...

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (from any thread) once the operation is done."""
        ...


class Transport(Protocol):
    """Where a reduction's bytes travel: one process group (see the package docstring)."""

    rank: int
    size: int
    # Whether reduce_scatter moves less than an allreduce (a ring's (N-1)/N of the data): a
    # sender that only wants its shard's sum cuts its buffers for it only where it does.
    cuts: bool

    def allreduce(self, t: torch.Tensor) -> InFlight:
        """``t`` becomes the sum of every rank's ``t``, in place: the group's own allreduce,
        issued from the calling thread (every transport alike; see :func:`_group_allreduce`)."""
        ...

    def reduce_scatter(
        self, chunks: Sequence[torch.Tensor], fallback: Sequence[torch.Tensor] | None = None
    ) -> InFlight:
        """Sum ``chunks[r]`` of every rank into rank r's ``chunks[r]``, in place.

        ``fallback`` (a narrow wire's full-precision source, cut alike): if any rank's reduced
        chunk holds inf or nan, ``fallback`` is reduce-scattered instead, decided alike on every
        rank; the handle's result is then True (False otherwise)."""
        ...

    def allgather(self, chunks: Sequence[torch.Tensor]) -> InFlight:
        """Every rank's ``chunks[i]`` becomes rank i's ``chunks[i]``, in place."""
        ...

    def broadcast(self, t: torch.Tensor, root: int) -> InFlight:
        """``t`` becomes rank ``root``'s ``t`` (``root`` a rank of the group), in place: the
        group's own broadcast, issued from the calling thread (see :func:`_group_broadcast`)."""
        ...

    def close(self) -> None:
        """Release what the transport holds (a worker thread); idempotent."""
        ...


class _Future:
    """A :class:`InFlight` over a ``concurrent.futures.Future``."""

    def __init__(self, fut: concurrent.futures.Future[object]) -> None:
        self._fut = fut

    def wait(self) -> object:
        return abort.wait_future(self._fut)

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        self._fut.add_done_callback(lambda _f: fn())


class _Work:
    """A :class:`InFlight` over a torch ``Work`` whose result lands in ``box``."""

    def __init__(self, work: dist.Work, box: list[object]) -> None:
        self._work, self._box = work, box

    def wait(self) -> object:
        abort.wait_work(self._work)
        return self._box[0] if self._box else None

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        self._work.get_future().then(lambda _f: fn())


def _group_allreduce(group: Group, t: torch.Tensor) -> InFlight:
    """The group's own summing allreduce of ``t``, under way: Gloo's and NCCL's, or the sealed
    and tcp groups' ring run as one operation of the group. Issued from the calling thread, in
    its order, as every other collective on the group; its bits are the group's allreduce's
    (the Gloo group's ring of :class:`Ring` sums in another order)."""
    WORKERS.settle(group)
    return _Work(dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True), [])


def _group_broadcast(group: Group, t: torch.Tensor, root: int) -> InFlight:
    """The group's own broadcast of rank ``root``'s ``t`` (a rank of ``group``), under way;
    issued from the calling thread, as :func:`_group_allreduce`."""
    pg = cast(dist.ProcessGroup, group)  # the runtime's groups are torch's (broadcast types it)
    WORKERS.settle(group)
    work: dist.Work | None = dist.broadcast(t, group=pg, group_src=root, async_op=True)
    assert work is not None  # asked for with async_op
    return _Work(work, [])


def _ring_reduce_scatter(
    link: Ring, chunks: Sequence[torch.Tensor], fallback: Sequence[torch.Tensor] | None
) -> bool:
    """The ring's reduce-scatter, with the narrow wire's overflow rule
    (:func:`~ringtrain.compression.overflow.redo_if_not_finite`): one job, so nothing another
    thread issues on the group can come between its rounds."""
    link.reduce_scatter_chunks(chunks, dist.ReduceOp.SUM)
    if fallback is None:
        return False
    return overflow.redo_if_not_finite(
        chunks[link.rank],
        lambda: link.reduce_scatter_chunks(fallback, dist.ReduceOp.SUM),
        overflow.any_rank(lambda flag: link.allreduce(flag, dist.ReduceOp.MAX)),
    )


def _staged(chunks: Sequence[torch.Tensor], fn: Callable[[list[torch.Tensor]], object]) -> object:
    """``fn`` on host copies of device chunks, copied back after (a ring's buffers are host
    memory)."""
    if all(c.device.type == "cpu" for c in chunks):
        return fn(list(chunks))
    host = [c.detach().cpu() for c in chunks]
    out = fn(host)
    for c, h in zip(chunks, host):
        c.copy_(h)
    return out


class RingTransport:
    """The ring (:class:`Ring`) over a group with asynchronous point-to-point (Gloo), run on
    the group's shared worker thread (:data:`~ringtrain.transport.workers.WORKERS`)."""

    cuts = True

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.rank, self.size = group.rank(), group.size()
        self._group = group
        self._link = Ring(group, Plain(self.rank, self.size))
        # The worker is taken at the first ring: a transport only allreducing starts no thread.
        self._worker = Hold(group)

    def _submit(self, fn: Callable[..., object], *args: object) -> InFlight:
        return _Future(self._worker.submit(fn, *args))

    def allreduce(self, t: torch.Tensor) -> InFlight:
        return _group_allreduce(self._group, t)

    def broadcast(self, t: torch.Tensor, root: int) -> InFlight:
        return _group_broadcast(self._group, t, root)

    def reduce_scatter(
        self, chunks: Sequence[torch.Tensor], fallback: Sequence[torch.Tensor] | None = None
    ) -> InFlight:
        def run() -> bool:
            if fallback is None:
                return bool(_staged(chunks, lambda c: _ring_reduce_scatter(self._link, c, None)))
            both = list(chunks) + list(fallback)
            n = len(chunks)
            return bool(_staged(both, lambda c: _ring_reduce_scatter(self._link, c[:n], c[n:])))

        return self._submit(run)

    def allgather(self, chunks: Sequence[torch.Tensor]) -> InFlight:
        return self._submit(lambda: _staged(chunks, self._link.allgather_chunks))

    def close(self) -> None:
        self._worker.release()


class RingGroupTransport:
    """A sealed or tcp group (:class:`RingProcessGroup`): the whole ring runs as one operation
    of the group, on its own link, whose transport posts a step's send and receive at once."""

    cuts = True

    def __init__(self, group: RingProcessGroup) -> None:
        self.rank, self.size = group.rank(), group.size()
        self._group = group

    def _submit(self, fn: Callable[[Ring], object]) -> InFlight:
        box: list[object] = []
        return _Work(self._group.run_on_link(lambda link: box.append(fn(link))), box)

    def allreduce(self, t: torch.Tensor) -> InFlight:
        return _group_allreduce(self._group, t)

    def broadcast(self, t: torch.Tensor, root: int) -> InFlight:
        return _group_broadcast(self._group, t, root)

    def reduce_scatter(
        self, chunks: Sequence[torch.Tensor], fallback: Sequence[torch.Tensor] | None = None
    ) -> InFlight:
        n = len(chunks)
        both = list(chunks) + list(fallback or [])
        return self._submit(
            lambda link: _staged(
                both, lambda c: _ring_reduce_scatter(link, c[:n], c[n:] if fallback else None)
            )
        )

    def allgather(self, chunks: Sequence[torch.Tensor]) -> InFlight:
        return self._submit(lambda link: _staged(chunks, link.allgather_chunks))

    def close(self) -> None:
        pass


class NcclTransport:
    """NCCL's own collectives. Chunks are padded to the largest (NCCL's reduce-scatter takes
    equal pieces); issued from the calling thread, completed on NCCL's stream."""

    cuts = True

    def __init__(self, group: Group) -> None:
        self.rank, self.size = group.rank(), group.size()
        self._group = group

    def _padded(self, chunks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int]:
        shard = max(c.numel() for c in chunks)
        buf = torch.zeros(shard * len(chunks), dtype=chunks[0].dtype, device=chunks[0].device)
        for i, c in enumerate(chunks):
            buf[i * shard : i * shard + c.numel()].copy_(c.reshape(-1))
        return buf, shard

    def allreduce(self, t: torch.Tensor) -> InFlight:
        return _group_allreduce(self._group, t)

    def broadcast(self, t: torch.Tensor, root: int) -> InFlight:
        return _group_broadcast(self._group, t, root)

    def reduce_scatter(
        self, chunks: Sequence[torch.Tensor], fallback: Sequence[torch.Tensor] | None = None
    ) -> InFlight:
        def once(pieces: Sequence[torch.Tensor]) -> None:
            buf, shard = self._padded(pieces)
            out = torch.empty(shard, dtype=buf.dtype, device=buf.device)
            dist.reduce_scatter_tensor(out, buf, group=self._group)
            mine = pieces[self.rank]
            mine.reshape(-1).copy_(out[: mine.numel()])

        once(chunks)
        redone = False
        if fallback is not None:
            redone = overflow.redo_if_not_finite(
                chunks[self.rank],
                lambda: once(fallback),
                overflow.any_rank(
                    lambda flag: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group),
                    chunks[0].device,
                ),
            )
        return _Done(redone)

    def allgather(self, chunks: Sequence[torch.Tensor]) -> InFlight:
        buf, shard = self._padded(chunks)
        mine = buf[self.rank * shard : (self.rank + 1) * shard].clone()
        dist.all_gather_into_tensor(buf, mine, group=self._group)
        for i, c in enumerate(chunks):
            c.reshape(-1).copy_(buf[i * shard : i * shard + c.numel()])
        return _Done(None)

    def close(self) -> None:
        pass


class _Done:
    """A :class:`InFlight` of an operation that completed as it was issued."""

    def __init__(self, result: object) -> None:
        self._result = result

    def wait(self) -> object:
        return self._result

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        fn()


class HierarchicalTransport:
    """The hierarchical (2D) allreduce as a transport over ``group``'s ranks.

    :class:`~ringtrain.transport.hierarchical.HierarchicalAllreduce` sums within each host
    (its host group), across hosts on shards (its cross-host groups), then shares within each
    host again. Wrapped over a stream's group, the engine sends a bucket to it as to any
    transport and never asks which it holds:

    * ``allreduce(t)``: the 2D allreduce of ``t``, in place, on the group's shared worker
      thread (:data:`~ringtrain.transport.workers.WORKERS`): blocking collectives, queued in
      the order the caller issues them, the same on every rank;
    * ``reduce_scatter(chunks, fallback)``: the whole of ``chunks`` allreduced (every chunk
      ends with its sum, not only this rank's), so ``cuts`` is False: a sender reduces whole
      buckets instead. The fallback's rule (:func:`~ringtrain.compression.overflow.
      redo_if_not_finite`) reads the whole result, the same on every rank, so every rank
      decides alike without agreeing;
    * ``allgather(chunks)``: the group's flat transport's.
    """

    cuts = False  # reduce_scatter reduces every chunk: no traffic saved over an allreduce

    def __init__(self, group: Group, algorithm: HierarchicalAllreduce) -> None:
        self._flat: Transport = of(group)
        self.rank, self.size = self._flat.rank, self._flat.size
        self._group = group
        self._algorithm = algorithm
        self._worker = Hold(group)  # taken at the first operation

    def _submit(self, fn: Callable[..., object], *args: object) -> InFlight:
        return _Future(self._worker.submit(fn, *args))

    def allreduce(self, t: torch.Tensor) -> InFlight:
        return self._submit(self._algorithm.allreduce, t, "sum")

    def reduce_scatter(
        self, chunks: Sequence[torch.Tensor], fallback: Sequence[torch.Tensor] | None = None
    ) -> InFlight:
        def whole(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
            flat = torch.cat([p.reshape(-1) for p in pieces])
            self._algorithm.allreduce(flat, "sum")
            for p, part in zip(pieces, torch.split(flat, [p.numel() for p in pieces])):
                p.copy_(part.view_as(p))
            return flat

        def run() -> bool:
            summed = whole(chunks)
            if fallback is None:
                return False
            return overflow.redo_if_not_finite(summed, lambda: whole(fallback))

        return self._submit(run)

    def allgather(self, chunks: Sequence[torch.Tensor]) -> InFlight:
        return self._flat.allgather(chunks)

    def broadcast(self, t: torch.Tensor, root: int) -> InFlight:
        return self._flat.broadcast(t, root)

    def close(self) -> None:
        self._worker.release()
        self._flat.close()


def of(group: Group, hierarchical: HierarchicalAllreduce | None = None) -> Transport:
    """The transport over ``group``: a sealed or tcp group runs the ring as its own operation,
    NCCL its own collectives, Gloo the ring on a worker thread; with ``hierarchical`` (a 2D
    allreduce over the same ranks' hosts), that allreduce
    (:class:`HierarchicalTransport`)."""
    if hierarchical is not None:
        return HierarchicalTransport(group, hierarchical)
    if isinstance(group, RingProcessGroup):
        return RingGroupTransport(group)
    if _backend(group) == "nccl":
        return NcclTransport(group)
    return RingTransport(cast(dist.ProcessGroup, group))  # the runtime's groups are torch's


def _backend(group: Group) -> str:
    try:
        return group_ops.backend(group)
    except (RuntimeError, ValueError):
        return ""
