"""Gradients through collectives, as in Horovod.

* allreduce: the gradient is allreduced with the same op and scale factors;
* allgather: each rank's gradient is the sum over ranks of the matching rows;
* broadcast: gradients are summed onto the root; other ranks get zeros;
* reducescatter: the gradient of each slice is allgathered (scaled as the forward was);
* alltoall: gradients travel back along the reverse splits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringtrain.collectives import ops
from ringtrain.collectives.reduce_ops import resolve_op
from ringtrain.runtime.process_sets import ProcessSet


def _grad_name(name: str | None) -> str | None:
    return None if name is None else f"{name}.grad"


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        average: Any,
        name: Any,
        compression: Any,
        op: Any,
        pre: float,
        post: float,
        ps: Any,
    ) -> torch.Tensor:
        ctx.args = (average, name, compression, op, pre, post, ps)
        return ops.synchronize(
            ops.allreduce_async(tensor, average, name, op, pre, post, ps, compression)
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        average, name, compression, op, pre, post, ps = ctx.args
        g = ops.synchronize(
            ops.allreduce_async(
                grad.contiguous(), average, _grad_name(name), op, pre, post, ps, compression
            )
        )
        return (g, None, None, None, None, None, None, None)


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
    return _Allreduce.apply(tensor, average, name, compression, op, pre, post, ps)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, ps: Any) -> torch.Tensor:
        ctx.args = (name, ps)
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.scalar = tensor.dim() == 0
        return ops.synchronize(ops.allgather_async(tensor, name, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        name, ps = ctx.args
        rows = ops.synchronize(
            ops.allgather_async(torch.tensor([ctx.rows]), _grad_name(name) and f"{name}.rows", ps)
        )
        summed = ops.synchronize(
            ops.allreduce_async(grad.contiguous(), name=_grad_name(name), op="Sum", process_set=ps)
        )
        me = ops.controller_of(ps).comm.set_rank
        start = int(rows[:me].sum())
        mine = summed[start : start + ctx.rows]
        return (mine.reshape(()) if ctx.scalar else mine), None, None


def allgather(tensor: torch.Tensor, name: Any, ps: ProcessSet | None) -> torch.Tensor:
    return _Allgather.apply(tensor, name, ps)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, name: Any, ps: Any) -> torch.Tensor:
        ctx.args = (root, name, ps)
        return ops.synchronize(ops.broadcast_async(tensor, root, name, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        root, name, ps = ctx.args
        summed = ops.synchronize(
            ops.allreduce_async(grad.contiguous(), name=_grad_name(name), op="Sum", process_set=ps)
        )
        if ops.controller_of(ps).comm.world_rank != root:  # a global rank, as in Horovod
            summed = torch.zeros_like(summed)
        return summed, None, None, None


def broadcast(tensor: torch.Tensor, root: int, name: Any, ps: ProcessSet | None) -> torch.Tensor:
    return _Broadcast.apply(tensor, root, name, ps)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: Any, op: Any, ps: Any, pre: float, post: float
    ) -> torch.Tensor:
        ctx.args = (name, resolve_op(op), ps, pre, post)
        return ops.synchronize(ops.reducescatter_async(tensor, name, op, ps, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        name, op, ps, pre, post = ctx.args
        full = ops.synchronize(ops.allgather_async(grad.contiguous(), _grad_name(name), ps))
        scale = pre * post
        if op == "Average":
            scale /= ops.controller_of(ps).comm.size
        return full * scale if scale != 1.0 else full, None, None, None, None, None


def reducescatter(
    tensor: torch.Tensor, name: Any, op: Any, ps: ProcessSet | None, pre: float, post: float
) -> torch.Tensor:
    return _Reducescatter.apply(tensor, name, op, ps, pre, post)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any, ps: Any) -> Any:
        ctx.args = (name, ps)
        # alltoall_async's handle gives (output, received_splits) either way, as Horovod's
        out, received = ops.synchronize(ops.alltoall_async(tensor, splits, name, ps))
        if splits is None:
            received = None
        ctx.received = received
        ctx.mark_non_differentiable(*([received] if received is not None else []))
        return (out, received) if received is not None else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> Any:
        name, ps = ctx.args
        back_splits = ctx.received.tolist() if ctx.received is not None else None
        g, _ = ops.synchronize(
            ops.alltoall_async(grad.contiguous(), back_splits, _grad_name(name), ps)
        )
        return g, None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None,
    name: Any,
    ps: ProcessSet | None,
) -> Any:
    return _Alltoall.apply(tensor, splits, name, ps)
