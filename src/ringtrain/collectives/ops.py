"""Tensor collectives with Horovod's names: sync, ``_async`` (a handle), in-place ``_``, grouped.

The non-blocking calls (``_async``, ``synchronize``, ``poll``) live in
:mod:`ringtrain.collectives.async_ops` and are re-exported here. The blocking calls below wait on
them; on tensors that require grad they go through the autograd functions in
:mod:`ringtrain.collectives.autograd`, which are built on the non-blocking calls (so neither of
those two modules imports this one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringtrain.collectives import autograd
from ringtrain.collectives.async_ops import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    broadcast_async,
    broadcast_async_,
    checked_root,
    controller_of,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    poll,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from ringtrain.collectives.reduce_ops import ReduceOpLike
from ringtrain.compression import CompressionLike
from ringtrain.compression import resolve as resolve_compression
from ringtrain.runtime.process_sets import ProcessSet

__all__ = [
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "checked_root",
    "controller_of",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
]


def _wants_grad(tensors: Sequence[Any]) -> bool:
    """Whether a sync call goes through autograd: a tensor requires grad and grad mode is on."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: CompressionLike | None = None,
    op: ReduceOpLike | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks of the process set (default: Average). Differentiable."""
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return autograd.allreduce(
            tensor, average, name, compression, op, prescale_factor, postscale_factor, process_set
        )
    return synchronize(
        allreduce_async(
            tensor, average, name, op, prescale_factor, postscale_factor, process_set, compression
        )
    )


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOpLike | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` in place and return it."""
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: CompressionLike | None = None,
    op: ReduceOpLike | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[torch.Tensor]:
    """Reduce a list of tensors as one unit. Differentiable, as Horovod's."""
    if _wants_grad(tensors):
        return autograd.grouped_allreduce(
            tensors, average, name, compression, op, prescale_factor, postscale_factor, process_set
        )
    return synchronize(
        grouped_allreduce_async(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set, compression
        )
    )


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOpLike | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[torch.Tensor]:
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


# ---- allgather -------------------------------------------------------------------------------


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet | None = None
) -> list[torch.Tensor]:
    """Allgather each tensor of a list, as one unit. Differentiable, as Horovod's."""
    if _wants_grad(tensors):
        return autograd.grouped_allgather(tensors, name, process_set)
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet | None = None
) -> torch.Tensor:
    """Concatenate ``tensor`` from all ranks along dim 0, in rank order. Differentiable."""
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return autograd.allgather(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """A copy of ``root_rank``'s tensor on every rank. Differentiable."""
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return autograd.broadcast(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, in place."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---- reducescatter ---------------------------------------------------------------------------


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: CompressionLike | None = None,
    op: ReduceOpLike | None = None,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reducescatter each tensor of a list, as one unit (Horovod's argument order, as
    :func:`reducescatter`). Differentiable, as Horovod's."""
    if _wants_grad(tensors):
        return autograd.grouped_reducescatter(
            tensors, name, compression, op, process_set, prescale_factor, postscale_factor
        )
    comp = resolve_compression(compression)
    sent = [comp.compress(t) if isinstance(t, torch.Tensor) else (t, None) for t in tensors]
    outs = synchronize(
        grouped_reducescatter_async(
            [c for c, _ in sent], name, op, process_set, prescale_factor, postscale_factor
        )
    )
    return [comp.decompress(o, ctx) for o, (_, ctx) in zip(outs, sent)]


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: CompressionLike | None = None,
    op: ReduceOpLike | None = None,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce ``tensor`` over ranks and return this rank's slice of dim 0. Differentiable."""
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return autograd.reducescatter(
            tensor, name, compression, op, process_set, prescale_factor, postscale_factor
        )
    comp = resolve_compression(compression)
    sent, ctx = comp.compress(tensor) if isinstance(tensor, torch.Tensor) else (tensor, None)
    out = synchronize(
        reducescatter_async(sent, name, op, process_set, prescale_factor, postscale_factor)
    )
    result: torch.Tensor = comp.decompress(out, ctx)  # comp: any compressor the caller gave
    return result


# ---- alltoall --------------------------------------------------------------------------------


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> Any:
    """All-to-all scatter/gather. Returns the output, or ``(output, received_splits)`` when
    ``splits`` is given, as Horovod does. Differentiable."""
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return autograd.alltoall(tensor, splits, name, process_set)
    out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return (out, received) if splits is not None else out
