"""The plain collectives run on a process group: the engine's besides its buckets' reductions,
and every collective of Horovod's API (``ringtrain.collectives``).

The engine's: small agreements (the plan's observations, a link rate, the auto tuner's probes
and verdicts), the sharded step's all-gathers, sparse gradients' all-gathers, a 16-bit bucket's
full-precision redo, a codec's own rounds (:class:`GroupRounds`: PowerSGD's factors, top-k's
values and indices), and making the engine's extra groups. With :func:`ringtrain.transport.of`
this is the one door to the wire for the engine and the collectives: neither calls
``torch.distributed`` itself (tests/engine/test_no_collectives_in_engine.py). The collectives'
besides: reductions by any of Horovod's ops, broadcast, all-to-all, reduce-scatter, the link
measure's point-to-point, and :class:`PreparedSum` (the fast lane's allreduce without the
per-call checks). Each function is the ``torch.distributed`` call of the same name
(``async_op=True`` returns its ``Work``), so behaviour and numerics are unchanged; the sealed
and tcp groups serve them as they serve any collective. In an elastic job the blocking ones on
host memory (a collective without ``async_op``, :func:`barrier`, :func:`all_gather_object`)
issue it async and wait through :func:`wait` or :func:`finish`, whose waits are sliced; a
send's or receive's never are (a Gloo one whose timed wait runs out closes the connection).
:func:`ring_reduce_scatter` is the collectives' door to the plain ring (``hvd.reducescatter``
on a Gloo group), so nothing above the transport builds a :class:`~ringtrain.transport.ring.Ring`
itself (an import contract in pyproject.toml holds it). Each of the group's own collectives
(numbered by the order they are issued in) first waits for the jobs on the group's worker that
issue its collectives unwaited (:meth:`~ringtrain.transport.workers.SharedWorkers.settle`: a
local update's link probe), so every rank issues them in one order.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Literal, cast, overload

import torch
import torch.distributed as dist

from ringtrain import compat
from ringtrain.runtime import abort, object_gather
from ringtrain.runtime.contracts import Group, Work
from ringtrain.transport.ring import Plain, Ring
from ringtrain.transport.workers import WORKERS


def _pg(group: Group | None) -> dist.ProcessGroup | None:
    """The runtime's groups are torch's ``ProcessGroup``s (runtime.contracts.Group types them
    by what ringtrain uses of them)."""
    return cast("dist.ProcessGroup | None", group)


# The reductions by name; "band" (bitwise AND) is the vector rounds' (integer tensors).
_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
    "band": dist.ReduceOp.BAND,
}


@overload
def allreduce(
    t: torch.Tensor, group: Group, op: str = ..., *, async_op: Literal[True]
) -> dist.Work: ...
@overload
def allreduce(
    t: torch.Tensor, group: Group, op: str = ..., async_op: Literal[False] = ...
) -> None: ...
def allreduce(
    t: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False
) -> dist.Work | None:
    """``t`` becomes the ``op`` ("sum", "max", "min", "product", "band") of every rank's ``t``,
    in place."""
    WORKERS.settle(group)
    return _blocking_or_not(
        t, async_op, lambda a: dist.all_reduce(t, op=_OPS[op], group=group, async_op=a)
    )


def _blocking_or_not(
    t: torch.Tensor, async_op: bool, call: Callable[[bool], dist.Work | None]
) -> dist.Work | None:
    """``call(async_op)``, the torch call. A blocking one on host memory in an elastic job is
    issued async and waited through :func:`finish`, in slices: the controller thread of a world
    a peer left without closing its connections leaves it once the launcher announces a new
    one, instead of sitting in Gloo until the transport timeout; so is one inside a
    :func:`~ringtrain.runtime.abort.stopping` check (the first step's plan agreement, which
    ends at the stall shutdown time as the step's exchange does). Elsewhere a blocking one
    that breaks because a peer left raises the error naming that peer, as every other wait
    does."""
    if async_op or t.is_cuda:
        return call(async_op)  # unchanged: torch's own call
    if not abort.sliced():
        try:
            call(False)
        except RuntimeError as e:  # a peer left ("Connection reset"): name it and its reason
            abort.raise_named(e)
        return None
    finish(call(True), t)
    return None


class PreparedSum:
    """A sum allreduce on one group, its options built once: what ``all_reduce(async_op=True)``
    calls, without its per-call checks and option building (the fast lane's, per op)."""

    def __init__(self, group: Group) -> None:
        self._group = cast(dist.ProcessGroup, group)
        self._opts = dist.AllreduceOptions()
        self._opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)

    def __call__(self, t: torch.Tensor) -> dist.Work:
        WORKERS.settle(self._group)
        return self._group.allreduce([t], self._opts)


def broadcast(t: torch.Tensor, group: Group, root: int, async_op: bool = False) -> dist.Work | None:
    """``t`` becomes the ``t`` of the rank ``root`` (its index in ``group``)."""
    WORKERS.settle(group)
    return _blocking_or_not(
        t, async_op, lambda a: dist.broadcast(t, group=_pg(group), group_src=root, async_op=a)
    )


def reduce_scatter_into(
    out: torch.Tensor, t: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False
) -> dist.Work | None:
    """``out`` becomes the ``op`` of every rank's r-th slice of ``t`` (r: this rank's index).
    Gloo's work ignores a timed wait (it waits to the group's timeout, checked on torch 2.13):
    there only other groups' waits are sliced."""
    WORKERS.settle(group)
    return _blocking_or_not(
        t,
        async_op,
        lambda a: compat.reduce_scatter_single(out, t, op=_OPS[op], group=group, async_op=a),
    )


def all_to_all(
    out: torch.Tensor,
    t: torch.Tensor,
    out_splits: Sequence[int] | None,
    in_splits: Sequence[int] | None,
    group: Group,
) -> dist.Work:
    """Rank r's ``out`` becomes every rank's r-th split of ``t`` (equal splits where None),
    under way (``wait()`` for it)."""
    WORKERS.settle(group)
    work: dist.Work = dist.all_to_all_single(
        out,
        t,
        output_split_sizes=None if out_splits is None else list(out_splits),
        input_split_sizes=None if in_splits is None else list(in_splits),
        group=group,
        async_op=True,
    )
    return work


def send(t: torch.Tensor, dst: int, group: Group | None, tag: int = 0) -> dist.Work | None:
    """Send ``t`` to world rank ``dst``, under way (matched by a :func:`recv` of ``tag``)."""
    work: dist.Work | None = dist.isend(t, dst, group=_pg(group), tag=tag)
    return work


def recv(t: torch.Tensor, src: int, group: Group | None, tag: int = 0) -> dist.Work | None:
    """Receive ``t`` from world rank ``src``, under way."""
    work: dist.Work | None = dist.irecv(t, src, group=_pg(group), tag=tag)
    return work


def barrier(group: Group | None) -> None:
    """Until every rank of ``group`` arrived; sliced as :func:`wait`."""
    WORKERS.settle(group)
    wait(dist.barrier(group=_pg(group), async_op=True))


def wait(work: Work | None) -> None:
    """Until ``work``, a collective's, is done. In an elastic job its wait is sliced and ends
    once the launcher replaced the world (:mod:`ringtrain.runtime.abort`): a peer lost mid-call
    does not hold the caller to the transport timeout. Not for :func:`send` and :func:`recv`:
    a Gloo send or receive whose timed wait runs out closes the connection."""
    assert work is not None  # issued with async_op=True by a member of the group
    abort.wait_work(work)


def finish(work: Work | None, t: torch.Tensor) -> None:
    """Until ``work``, a collective's on ``t``, is done. On host memory, where this thread's
    waits are sliced (:func:`~ringtrain.runtime.abort.sliced`), as :func:`wait`; elsewhere the
    plain ``wait()`` of torch's blocking call, as before (on a CUDA tensor too: NCCL's timed
    wait was never checked on a GPU here)."""
    assert work is not None  # issued with async_op=True by a member of the group
    if not abort.sliced() or t.is_cuda:
        work.wait()
    else:
        abort.wait_work(work)


def rank(group: Group | None) -> int:
    """This rank's index in ``group`` (None: the default group)."""
    return dist.get_rank(_pg(group))


def size(group: Group | None) -> int:
    """The ranks in ``group`` (None: the default group)."""
    return dist.get_world_size(_pg(group))


@overload
def all_gather_into(
    out: torch.Tensor, t: torch.Tensor, group: Group, *, async_op: Literal[True]
) -> dist.Work: ...
@overload
def all_gather_into(
    out: torch.Tensor, t: torch.Tensor, group: Group, async_op: Literal[False] = ...
) -> None: ...
def all_gather_into(
    out: torch.Tensor, t: torch.Tensor, group: Group, async_op: bool = False
) -> dist.Work | None:
    """``out`` (size x ``t``'s elements) becomes every rank's ``t``, in rank order."""
    WORKERS.settle(group)
    return _blocking_or_not(
        t, async_op, lambda a: compat.all_gather_single(out, t, group=group, async_op=a)
    )


def all_gather(
    outs: list[torch.Tensor], t: torch.Tensor, group: Group, async_op: bool = False
) -> dist.Work | None:
    """``outs[r]`` becomes rank r's ``t``."""
    WORKERS.settle(group)
    return _blocking_or_not(
        t, async_op, lambda a: dist.all_gather(outs, t, group=group, async_op=a)
    )


def ring_reduce_scatter(chunks: Sequence[torch.Tensor], group: dist.ProcessGroup, op: str) -> int:
    """Rank r's ``chunks[r]`` becomes the ``op`` (as :func:`allreduce`'s) of every rank's
    ``chunks[r]``, around ringtrain's plain ring (:class:`~ringtrain.transport.ring.Ring`) on the
    calling thread: each rank sends every other rank's chunk once (Gloo's reduce_scatter
    allreduces the whole input: twice the bytes), summing in an order fixed by rank, not timing.
    For host memory on a group with asynchronous point-to-point (Gloo). Returns this rank's index
    in ``group`` (whose chunk is complete)."""
    link = Ring(group, Plain(group.rank(), group.size()))
    link.reduce_scatter_chunks(list(chunks), _OPS[op])
    return link.rank


def all_gather_object(outs: list[object], obj: object, group: Group | None) -> None:
    """``outs[r]`` becomes rank r's ``obj`` (pickled). On host memory its waits are sliced as
    :func:`wait`'s; NCCL's pickles travel in device memory, as torch's own call sends them."""
    WORKERS.settle(group)
    if group is None or _on_device(group):
        dist.all_gather_object(outs, obj, group=_pg(group))
        return
    outs[:] = object_gather.all_gather_object(obj, len(outs), group, wait)


def _on_device(group: Group) -> bool:
    """Whether ``group`` carries device memory (NCCL). A backend object made directly, not
    through torch's registry (as a test makes one), carries host memory."""
    try:
        return backend(group) == "nccl"
    except ValueError:
        return False


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
