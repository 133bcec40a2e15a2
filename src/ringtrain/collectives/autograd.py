"""Gradients through collectives, defined as Horovod defines them (``horovod/torch/mpi_ops.py``).

Horovod's gradients are conventions, not all the derivative of one total loss; ringtrain keeps
them so that a model ported from Horovod computes the same numbers. With ``n`` the size of the
process set and ``g_k`` the gradient arriving at rank ``k``:

* ``allreduce``, ``grouped_allreduce``: ``g`` is allreduced with the forward's op, ``prescale``
  and ``postscale`` factors and process set (Sum: ``pre*post*sum_k g_k``; Average: the mean).
* ``allgather``, ``grouped_allgather``: ``g`` is *averaged* over the set (``mean_k g_k``) and each
  rank keeps the rows it contributed: ``1/n`` of the derivative of the summed loss.
* ``broadcast``: ``g`` is *averaged* over the set and kept by the root (a global rank, compared
  with ``rank()`` as Horovod does); every other rank gets zeros.
* ``reducescatter``, ``grouped_reducescatter``: the slices ``g_k`` are allgathered and multiplied
  by ``pre*post``, and by ``n`` when the op is Sum (not when it is Average).
* ``alltoall``: ``g`` travels back along the splits each rank received (the exact adjoint).

Compression wraps the autograd function (compress, collective, decompress), as in Horovod, so a
gradient crosses the wire in the same dtype as the forward's tensor did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringtrain.collectives import async_ops
from ringtrain.collectives.handles import synchronize
from ringtrain.collectives.reduce_ops import resolve_allreduce_op, resolve_op
from ringtrain.compression import resolve as resolve_compression
from ringtrain.runtime.process_sets import ProcessSet


def _grad_name(name: str | None, suffix: str = "grad") -> str | None:
    return None if name is None else f"{name}.{suffix}"


def _compressed(compression: Any, tensors: Sequence[torch.Tensor]) -> tuple[Any, list[Any]]:
    """The compressor and each tensor compressed (differentiably: a cast), with its context."""
    comp = resolve_compression(compression)
    return comp, [comp.compress(t) for t in tensors]


def _set_size(ps: ProcessSet | None) -> int:
    return async_ops.controller_of(ps).comm.size


def _own_rows(
    grads: Sequence[torch.Tensor], rows: Sequence[int], scalars: Sequence[bool], name: Any, ps: Any
) -> list[torch.Tensor]:
    """Horovod's allgather backward: average each gradient over the set, keep this rank's rows."""
    averaged = async_ops.grouped_allreduce_async(
        [g.contiguous() for g in grads], name=_grad_name(name), op="Average", process_set=ps
    )
    # Every rank's row counts, one gathered row per rank (the counts may differ per rank).
    counts = async_ops.allgather_async(torch.tensor([list(rows)]), _grad_name(name, "rows"), ps)
    averaged_grads = synchronize(averaged)
    starts = synchronize(counts)[: async_ops.controller_of(ps).comm.set_rank].sum(0).tolist()
    out = []
    for g, start, n, scalar in zip(averaged_grads, starts, rows, scalars):
        mine = g[start : start + n]
        out.append(mine.reshape(()) if scalar else mine)
    return out


# ---- allreduce -------------------------------------------------------------------------------


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: str, name: Any, pre: float, post: float, ps: Any
    ) -> torch.Tensor:
        ctx.args = (op, name, pre, post, ps)
        return synchronize(async_ops.allreduce_async(tensor, None, name, op, pre, post, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, name, pre, post, ps = ctx.args
        g = synchronize(
            async_ops.allreduce_async(grad.contiguous(), None, _grad_name(name), op, pre, post, ps)
        )
        return g, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: Any,
    name: Any,
    compression: Any,
    op: Any,
    pre: float,
    post: float,
    ps: ProcessSet | None,
) -> torch.Tensor:
    op_name = resolve_allreduce_op(op, average, ps)
    comp, [(sent, ctx)] = _compressed(compression, [tensor])
    out = _Allreduce.apply(sent, op_name, name, pre, post, ps)
    return comp.decompress(out, ctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, op: str, name: Any, pre: float, post: float, ps: Any, *tensors: torch.Tensor
    ) -> Any:
        ctx.args = (op, name, pre, post, ps)
        return tuple(
            synchronize(
                async_ops.grouped_allreduce_async(list(tensors), None, name, op, pre, post, ps)
            )
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, name, pre, post, ps = ctx.args
        g = synchronize(
            async_ops.grouped_allreduce_async(
                [x.contiguous() for x in grads], None, _grad_name(name), op, pre, post, ps
            )
        )
        return (None, None, None, None, None, *g)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: Any,
    name: Any,
    compression: Any,
    op: Any,
    pre: float,
    post: float,
    ps: ProcessSet | None,
) -> list[torch.Tensor]:
    op_name = resolve_allreduce_op(op, average, ps)
    comp, sent = _compressed(compression, tensors)
    outs = _GroupedAllreduce.apply(op_name, name, pre, post, ps, *(s for s, _ in sent))
    return [comp.decompress(o, ctx) for o, (_, ctx) in zip(outs, sent)]


# ---- allgather -------------------------------------------------------------------------------


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, ps: Any, *tensors: torch.Tensor) -> Any:
        ctx.args = (name, ps)
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.scalars = [t.dim() == 0 for t in tensors]
        return tuple(synchronize(async_ops.grouped_allgather_async(list(tensors), name, ps)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        name, ps = ctx.args
        return (None, None, *_own_rows(grads, ctx.rows, ctx.scalars, name, ps))


def allgather(tensor: torch.Tensor, name: Any, ps: ProcessSet | None) -> torch.Tensor:
    (out,) = _Allgather.apply(name, ps, tensor)
    return out


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: Any, ps: ProcessSet | None
) -> list[torch.Tensor]:
    return list(_Allgather.apply(name, ps, *tensors))


# ---- broadcast -------------------------------------------------------------------------------


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, name: Any, ps: Any) -> torch.Tensor:
        ctx.args = (root, name, ps)
        return synchronize(async_ops.broadcast_async(tensor, root, name, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        root, name, ps = ctx.args
        averaged = synchronize(
            async_ops.allreduce_async(
                grad.contiguous(), name=_grad_name(name), op="Average", process_set=ps
            )
        )
        if async_ops.controller_of(ps).comm.world_rank != root:  # a global rank, as in Horovod
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


def broadcast(tensor: torch.Tensor, root: int, name: Any, ps: ProcessSet | None) -> torch.Tensor:
    return _Broadcast.apply(tensor, root, name, ps)


# ---- reducescatter ---------------------------------------------------------------------------


def _scattered_grads(grads: Sequence[torch.Tensor], ctx: Any) -> list[torch.Tensor]:
    name, op, ps, pre, post = ctx.args
    # Horovod's convention: Sum's gradient is n times the slices, Average's is the slices.
    scale = pre * post * (_set_size(ps) if op == "Sum" else 1)
    scaled = [g.contiguous() * scale if scale != 1.0 else g.contiguous() for g in grads]
    return synchronize(async_ops.grouped_allgather_async(scaled, _grad_name(name), ps))


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, name: Any, op: str, ps: Any, pre: float, post: float, *tensors: torch.Tensor
    ) -> Any:
        ctx.args = (name, op, ps, pre, post)
        return tuple(
            synchronize(
                async_ops.grouped_reducescatter_async(list(tensors), name, op, ps, pre, post)
            )
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, None, None, None, *_scattered_grads(grads, ctx))


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: Any,
    compression: Any,
    op: Any,
    ps: ProcessSet | None,
    pre: float,
    post: float,
) -> list[torch.Tensor]:
    comp, sent = _compressed(compression, tensors)
    outs = _Reducescatter.apply(name, resolve_op(op), ps, pre, post, *(s for s, _ in sent))
    return [comp.decompress(o, ctx) for o, (_, ctx) in zip(outs, sent)]


def reducescatter(
    tensor: torch.Tensor,
    name: Any,
    compression: Any,
    op: Any,
    ps: ProcessSet | None,
    pre: float,
    post: float,
) -> torch.Tensor:
    (out,) = grouped_reducescatter([tensor], name, compression, op, ps, pre, post)
    return out


# ---- alltoall --------------------------------------------------------------------------------


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any, ps: Any) -> Any:
        out, received = synchronize(async_ops.alltoall_async(tensor, splits, name, ps))
        ctx.args = (name, ps)
        # Without splits, ranks may still send different row counts (dim 0 / n each): the
        # gradient goes back along what each rank really received, never an even split.
        ctx.received = [int(s) for s in received.tolist()]
        ctx.rows = tensor.shape[0] if tensor.dim() else 0
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> Any:
        name, ps = ctx.args
        g, _ = synchronize(
            async_ops.alltoall_async(grad.contiguous(), ctx.received, _grad_name(name), ps)
        )
        if g.dim() and g.shape[0] < ctx.rows:  # rows the splits left unsent: no gradient
            g = torch.cat([g, g.new_zeros((ctx.rows - g.shape[0], *g.shape[1:]))])
        return g, None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None,
    name: Any,
    ps: ProcessSet | None,
) -> Any:
    return _Alltoall.apply(tensor, splits, name, ps)
