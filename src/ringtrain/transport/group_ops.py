"""The plain collectives the engine runs on a process group besides its buckets' reductions.

Small agreements (the plan's observations, a link rate, the auto tuner's probes and verdicts),
the sharded step's all-gathers, sparse gradients' all-gathers, a 16-bit bucket's
full-precision redo, a codec's own rounds (:class:`GroupRounds`: PowerSGD's factors, top-k's
values and indices), and making the engine's extra groups. With :func:`ringtrain.transport.of`
this is the engine's one door to the wire: ``engine/`` never calls ``torch.distributed`` itself
(tests/engine/test_no_collectives_in_engine.py). Each function is the ``torch.distributed``
call of the same name (``async_op=True`` returns its ``Work``), so behaviour and numerics are
unchanged; the sealed and tcp groups serve them as they serve any collective.
:func:`ring_reduce_scatter` is the collectives' door to the plain ring (``hvd.reducescatter``
on a Gloo group), so nothing above the transport builds a :class:`~ringtrain.transport.ring.Ring`
itself (an import contract in pyproject.toml holds it).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist

from ringtrain import compat
from ringtrain.runtime import abort
from ringtrain.runtime.contracts import Group
from ringtrain.transport.ring import Plain, Ring

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def allreduce(
    t: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False
) -> dist.Work | None:
    """``t`` becomes the ``op`` ("sum", "max") of every rank's ``t``, in place."""
    work: dist.Work | None = dist.all_reduce(t, op=_OPS[op], group=group, async_op=async_op)
    return work


def all_gather_into(
    out: torch.Tensor, t: torch.Tensor, group: Group, async_op: bool = False
) -> dist.Work | None:
    """``out`` (size x ``t``'s elements) becomes every rank's ``t``, in rank order."""
    work: dist.Work | None = compat.all_gather_single(out, t, group=group, async_op=async_op)
    return work


def all_gather(
    outs: list[torch.Tensor], t: torch.Tensor, group: Group, async_op: bool = False
) -> dist.Work | None:
    """``outs[r]`` becomes rank r's ``t``."""
    work: dist.Work | None = dist.all_gather(outs, t, group=group, async_op=async_op)
    return work


def ring_reduce_scatter(
    chunks: Sequence[torch.Tensor], group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType
) -> int:
    """Rank r's ``chunks[r]`` becomes the ``op`` (a ``dist.ReduceOp`` member) of every rank's
    ``chunks[r]``, around ringtrain's plain ring (:class:`~ringtrain.transport.ring.Ring`) on the
    calling thread: each rank sends every other rank's chunk once (Gloo's reduce_scatter
    allreduces the whole input: twice the bytes), summing in an order fixed by rank, not timing.
    For host memory on a group with asynchronous point-to-point (Gloo). Returns this rank's index
    in ``group`` (whose chunk is complete)."""
    link = Ring(group, Plain(group.rank(), group.size()))
    link.reduce_scatter_chunks(list(chunks), op)
    return link.rank


def all_gather_object(outs: list[object], obj: object, group: Group) -> None:
    """``outs[r]`` becomes rank r's ``obj`` (pickled)."""
    dist.all_gather_object(outs, obj, group=group)


def backend(group: Group) -> str:
    """The name of torch's backend behind ``group`` ("gloo", "nccl", ...): the runtime's groups
    are torch's ``ProcessGroup``."""
    return str(dist.get_backend(cast(dist.ProcessGroup, group)))


def new_group(ranks: Sequence[int], backend: str, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A new group of ``ranks`` on ``backend``. Collective over the world: every rank makes the
    same groups in the same order."""
    group: dist.ProcessGroup = dist.new_group(
        list(ranks), timeout=timeout, backend=backend, use_local_synchronization=False
    )
    return group


class _Round:
    """A round under way (:class:`ringtrain.compression.codec.Round`)."""

    def __init__(self, work: dist.Work | None) -> None:
        assert work is not None  # issued with async_op=True
        self._work = work

    def wait(self) -> None:
        abort.wait_work(self._work)


class GroupRounds:
    """A codec's rounds (:class:`ringtrain.compression.codec.Rounds`) on a process group:
    issued from the calling thread, each the ``torch.distributed`` call of the same name."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.rank, self.size = group.rank(), group.size()

    def allreduce(self, t: torch.Tensor) -> _Round:
        return _Round(allreduce(t, self.group, async_op=True))

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor) -> _Round:
        return _Round(all_gather_into(out, t, self.group, async_op=True))

    def all_gather(self, outs: list[torch.Tensor], t: torch.Tensor) -> _Round:
        return _Round(all_gather(outs, t, self.group, async_op=True))


def rounds(group: Group) -> GroupRounds:
    """What a codec with rounds of its own (PowerSGD, top-k) runs them on, over ``group``."""
    return GroupRounds(group)
