"""Tensor collectives with Horovod's names: sync, ``_async`` (a handle), in-place ``_``, grouped.

The non-blocking calls (``_async``, ``synchronize``, ``poll``) live in
:mod:`ringtrain.collectives.async_ops` and are re-exported here. The blocking calls below wait on
them; on tensors that require grad they go through the autograd functions in
:mod:`ringtrain.collectives.autograd`, which are built on the non-blocking calls (so neither of
those two modules imports this one).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import torch

from ringtrain.collectives import autograd
from ringtrain.collectives.async_ops import (
    GROUPED,
    GROUPED_IN_PLACE,
    IN_PLACE,
    PLAIN,
    Variant,
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
    reducescatter_async,
    sparse_allreduce_async,
)
from ringtrain.collectives.handles import Handle, poll, synchronize
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


P = ParamSpec("P")
R = TypeVar("R")


def _wants_grad(tensors: Sequence[Any]) -> bool:
    """Whether a sync call goes through autograd: a tensor requires grad and grad mode is on."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def _blocking(
    start: Callable[P, Handle[R]],
    variant: Variant,
    doc: str,
    differentiable: Callable[..., R] | None = None,
) -> Callable[P, R]:
    """Horovod's blocking spelling of ``start`` (``allgather`` of ``allgather_async``): the same
    parameters, waits for the result. With ``differentiable`` (the autograd function, taking the
    same arguments in order), a tensor that requires grad goes through it instead. The
    signature, name and docstring are the blocking call's own, for type checkers and ``help``."""
    sig = inspect.signature(start)
    first = next(iter(sig.parameters))

    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        if differentiable is not None:
            given: Any = args[0] if args else kwargs.get(first)
            if _wants_grad(list(given) if variant.grouped else [given]):
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                return differentiable(*bound.args)
        return synchronize(start(*args, **kwargs))

    call.__name__ = call.__qualname__ = start.__name__.replace("_async", "")
    call.__doc__ = doc
    returns = str(sig.return_annotation).removeprefix("Handle[").removesuffix("]")
    setattr(call, "__signature__", sig.replace(return_annotation=returns))  # noqa: B010
    return call


# Horovod's blocking calls that take exactly their non-blocking twin's arguments.
allreduce_ = _blocking(allreduce_async_, IN_PLACE, "Reduce ``tensor`` in place and return it.")
grouped_allreduce_ = _blocking(
    grouped_allreduce_async_,
    GROUPED_IN_PLACE,
    "Reduce a list of tensors in place, as one unit, and return them.",
)
allgather = _blocking(
    allgather_async,
    PLAIN,
    "Concatenate ``tensor`` from all ranks along dim 0, in rank order. Differentiable.",
    autograd.allgather,
)
grouped_allgather = _blocking(
    grouped_allgather_async,
    GROUPED,
    "Allgather each tensor of a list, as one unit. Differentiable, as Horovod's.",
    autograd.grouped_allgather,
)
broadcast = _blocking(
    broadcast_async,
    PLAIN,
    "A copy of ``root_rank``'s tensor on every rank. Differentiable.",
    autograd.broadcast,
)
broadcast_ = _blocking(
    broadcast_async_, IN_PLACE, "Overwrite ``tensor`` with ``root_rank``'s, in place."
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
    if _wants_grad([tensor]):
        return autograd.allreduce(
            tensor, average, name, compression, op, prescale_factor, postscale_factor, process_set
        )
    return synchronize(
        allreduce_async(
            tensor, average, name, op, prescale_factor, postscale_factor, process_set, compression
        )
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


# ---- reducescatter ---------------------------------------------------------------------------


def _reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None,
    compression: CompressionLike | None,
    op: ReduceOpLike | None,
    process_set: ProcessSet | None,
    prescale_factor: float,
    postscale_factor: float,
) -> list[torch.Tensor]:
    """The blocking reducescatter of a list, compressed around the collective, as Horovod's."""
    comp = resolve_compression(compression)
    sent = [comp.compress(t) if isinstance(t, torch.Tensor) else (t, None) for t in tensors]
    args = (name, op, process_set, prescale_factor, postscale_factor)
    outs = synchronize(grouped_reducescatter_async([c for c, _ in sent], *args))
    return [comp.decompress(o, ctx) for o, (_, ctx) in zip(outs, sent)]


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
    args = (name, compression, op, process_set, prescale_factor, postscale_factor)
    if _wants_grad(tensors):
        return autograd.grouped_reducescatter(tensors, *args)
    return _reducescatter(tensors, *args)


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
    args = (name, compression, op, process_set, prescale_factor, postscale_factor)
    if _wants_grad([tensor]):
        return autograd.reducescatter(tensor, *args)
    return _reducescatter([tensor], *args)[0]


# ---- alltoall --------------------------------------------------------------------------------


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> Any:
    """All-to-all scatter/gather. Returns the output, or ``(output, received_splits)`` when
    ``splits`` is given, as Horovod does. Differentiable."""
    if _wants_grad([tensor]):
        return autograd.alltoall(tensor, splits, name, process_set)
    out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return (out, received) if splits is not None else out
