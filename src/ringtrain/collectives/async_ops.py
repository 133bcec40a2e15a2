"""The non-blocking collectives: each returns a :class:`Handle` that ``synchronize`` waits on.

Every function builds a :class:`Request` (what the other ranks compare against), finds the
controller of the process set, and submits. Argument problems found here are not raised at once:
they ride along in the request, so every rank raises the same error when the name is negotiated,
instead of one rank raising while its peers wait forever. The public module is
:mod:`ringtrain.collectives.ops`, which re-exports these and adds the blocking calls.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ringtrain.collectives import dtypes
from ringtrain.collectives.controller import Controller
from ringtrain.collectives.handles import CompositeHandle, Handle
from ringtrain.collectives.reduce_ops import ReduceOpLike, resolve_allreduce_op, resolve_op
from ringtrain.collectives.requests import Request, TensorMeta
from ringtrain.compression import CompressionLike
from ringtrain.compression import resolve as resolve_compression
from ringtrain.compression.halfprec import NoneCompressor
from ringtrain.errors import CollectiveAbortedError, CollectiveArgumentError
from ringtrain.runtime import state
from ringtrain.runtime.process_sets import ProcessSet


def controller_of(process_set: ProcessSet | None) -> Controller:
    ps = process_set if process_set is not None else state.global_process_set
    state.current()
    comm = ps.communicator
    if not comm.included:
        raise CollectiveArgumentError(
            f"rank {comm.world_rank} is not a member of {ps!r}.\n"
            "HINT: only call collectives of a process set on its member ranks (ps.included())."
        )
    ctl: Controller | None = comm.service("controller")
    if ctl is None:
        raise CollectiveAbortedError(f"{ps!r} has no running controller; was ringtrain shut down?")
    return ctl


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(t.shape), str(t.dtype), str(t.device))


def _check_tensors(kind: str, tensors: Sequence[Any]) -> str:
    """An error message for tensors a collective cannot take, or ''."""
    for i, t in enumerate(tensors):
        where = f" (item {i})" if len(tensors) > 1 else ""
        if not isinstance(t, torch.Tensor):
            return f"{kind} expects a torch.Tensor{where}, got {type(t).__name__}"
        if t.is_sparse:
            return (
                f"{kind} got a sparse tensor{where}; convert it with .to_dense(), or use "
                "DistributedOptimizer, which handles sparse gradients"
            )
        if kind in ("allgather", "reducescatter", "alltoall") and t.dim() == 0:
            # Horovod's controller: "Rank zero tried to ALLGATHER a rank-zero tensor."
            return (
                f"{kind} needs a tensor with at least one dimension{where}; got a 0-d tensor, "
                f"as Horovod refuses.\nHINT: t.reshape(1) (or t.unsqueeze(0)) makes it one row."
            )
    return ""


def _contiguity_error(kind: str, tensors: Sequence[Any]) -> str:
    """Horovod's ``ValueError('Tensor is required to be contiguous.')``, or ''."""
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_contiguous():
            where = f" (item {i})" if len(tensors) > 1 else ""
            return (
                f"{kind} needs contiguous tensors, as Horovod's do{where}: shape "
                f"{tuple(t.shape)}, strides {t.stride()}.\nHINT: pass t.contiguous() (for an "
                "in-place op, copy the result back: t.copy_(result))."
            )
    return ""


def _written_error(kind: str, tensors: Sequence[Any]) -> str:
    """An error for an in-place ``kind`` into a tensor whose elements share memory, or ''.

    Checked at submission: torch refuses to write such a tensor only when the result lands, on
    the controller's thread after the data moved, which failed the process set on every rank.
    The test is torch's own for writes (``has_internal_overlap``, not public): a stride of 0 in
    a dimension of more than one element, as ``.expand()`` makes; overlaps it cannot tell, torch
    writes too."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            continue  # the general checks explain
        if t.is_contiguous():  # row-major strides: none is 0 where the size is above 1
            continue
        if any(n > 1 and s == 0 for n, s in zip(t.shape, t.stride())):
            where = f" (item {i})" if len(tensors) > 1 else ""
            return (
                f"an in-place {kind} cannot write its result into a tensor whose elements "
                f"share memory{where}: shape {tuple(t.shape)}, strides {t.stride()} (an "
                f".expand() view?).\nHINT: pass t.clone() or t.contiguous() and use what comes "
                f"back, or call {kind}() for a new tensor."
            )
    return ""


def _submit(
    kind: str,
    tensors: Sequence[Any],
    name: str | None,
    process_set: ProcessSet | None,
    finish: Callable[[Any], Any],
    outputs: list[torch.Tensor] | None = None,
    check: Callable[[], str] | None = None,
    **fields: Any,
) -> Handle[Any]:
    ctl = controller_of(process_set)
    name = name if name is not None else ctl.auto_name(kind)
    error = (
        _check_tensors(kind, tensors)
        or (check() if check else "")
        or _contiguity_error(kind, tensors)
    )
    if error:
        return ctl.submit(Request(name, kind, error=error, **fields), [], [], finish)
    return ctl.submit(
        Request(name, kind, tuple(_meta(t) for t in tensors), **fields),
        list(tensors),
        outputs,
        finish,
    )


# ---- Horovod's spellings ---------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """How one of Horovod's spellings of a collective differs from the plain call.

    ``inplace`` (``allreduce_``, ``broadcast_async_``): the result is written into the caller's
    tensors, which come back. ``grouped`` (``grouped_allreduce``): a list of tensors negotiated
    and fused as one unit, and a list back. The public functions below are thin typed wrappers,
    one per spelling, over one implementation per collective that takes the variant.
    """

    inplace: bool = False
    grouped: bool = False

    def result(self, outs: list[Any]) -> Any:
        return outs if self.grouped else outs[0]


PLAIN = Variant()
IN_PLACE = Variant(inplace=True)
GROUPED = Variant(grouped=True)
GROUPED_IN_PLACE = Variant(inplace=True, grouped=True)


def _detached(tensors: Sequence[Any]) -> list[Any]:
    return [t.detach() if isinstance(t, torch.Tensor) else t for t in tensors]


# ---- allreduce -------------------------------------------------------------------------------


def _allreduce(
    variant: Variant,
    tensors: Sequence[Any],
    average: bool | None,
    name: str | None,
    op: ReduceOpLike | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet | None,
    compression: CompressionLike | None = None,
) -> Handle[Any]:
    op_name = resolve_allreduce_op(op, average, process_set)
    pre, post = float(prescale_factor), float(postscale_factor)
    unwritable = _written_error("allreduce", tensors) if variant.inplace else ""
    if name is not None and not variant.grouped and compression in _UNCOMPRESSED and not unwritable:
        handle = _repeat(variant, tensors[0], name, op_name, pre, post, process_set)
        if handle is not None:
            return handle
    tensors = list(tensors)  # read twice: sent now, handed back in place
    comp = resolve_compression(compression)
    inputs = _detached(tensors)
    sent, ctxs = [], []
    for d in inputs:
        if isinstance(d, torch.Tensor):
            c, ctx = comp.compress(d)
        else:
            c, ctx = d, None
        sent.append(c)
        ctxs.append(ctx)
    # Uncompressed in-place ops reduce in the caller's tensors: no copy, no allocation.
    same = all(s is d for s, d in zip(sent, inputs))
    if variant.inplace and same:
        outputs = list(inputs)
    else:
        outputs = [torch.empty_like(s) if isinstance(s, torch.Tensor) else s for s in sent]

    def finish(result: list[torch.Tensor]) -> Any:
        outs = [comp.decompress(r, ctx) for r, ctx in zip(result, ctxs)]
        if variant.inplace:
            if not same:
                for t, o in zip(tensors, outs):
                    t.detach().copy_(o)
            outs = list(tensors)
        return variant.result(outs)

    return _submit(
        "allreduce",
        sent,
        name,
        process_set,
        finish,
        outputs,
        lambda: unwritable or dtypes.refusal(sent, op_name, pre, post),
        op=op_name,
        prescale=pre,
        postscale=post,
    )


_UNCOMPRESSED = (None, NoneCompressor, "none")


def _repeat(
    variant: Variant,
    t: torch.Tensor,
    name: str,
    op: str,
    pre: float,
    post: float,
    process_set: ProcessSet | None,
) -> Handle[torch.Tensor] | None:
    """A named allreduce the set ran before, submitted with its request again: the fast lane's
    reservation or the request cache's, found by comparing the arguments with it, so a repeated
    op builds no request, metadata or lists of its own (issue 38: the caller's Python per op).
    None: take the general path."""
    if not isinstance(t, torch.Tensor) or t.requires_grad or not t.is_contiguous():
        return None  # the general path explains (not a tensor, not contiguous), or detaches
    ctl = controller_of(process_set)
    request = ctl.repeat_of(name, t, op, pre, post)
    if request is None:
        return None
    # A view is detached as the general path does (an Average scales it in place); the caller
    # gets back what it passed in.
    data = t.detach() if t._is_view() else t
    if not variant.inplace:
        return ctl.submit(request, [data], [torch.empty_like(data)], _FIRST)
    return ctl.submit(request, [data], [data], _FIRST if data is t else lambda _: t)


_FIRST = operator.itemgetter(0)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOpLike | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
    compression: CompressionLike | None = None,
) -> Handle[torch.Tensor]:
    """Start reducing ``tensor`` over the ranks; ``synchronize`` returns a new tensor."""
    args = (average, name, op, prescale_factor, postscale_factor, process_set, compression)
    return _allreduce(PLAIN, [tensor], *args)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOpLike | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> Handle[torch.Tensor]:
    """In-place version of :func:`allreduce_async`: ``tensor`` receives the result."""
    args = (average, name, op, prescale_factor, postscale_factor, process_set)
    return _allreduce(IN_PLACE, [tensor], *args)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOpLike | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
    compression: CompressionLike | None = None,
) -> Handle[list[torch.Tensor]]:
    """Reduce a list of tensors as one unit (negotiated and fused together)."""
    args = (average, name, op, prescale_factor, postscale_factor, process_set, compression)
    return _allreduce(GROUPED, tensors, *args)


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOpLike | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> Handle[list[torch.Tensor]]:
    """In-place version of :func:`grouped_allreduce_async`: each tensor receives its result."""
    args = (average, name, op, prescale_factor, postscale_factor, process_set)
    return _allreduce(GROUPED_IN_PLACE, tensors, *args)


# ---- allgather -------------------------------------------------------------------------------


def _allgather(
    variant: Variant, tensors: Sequence[Any], name: str | None, process_set: ProcessSet | None
) -> Handle[Any]:
    return _submit("allgather", _detached(tensors), name, process_set, variant.result)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet | None = None
) -> Handle[list[torch.Tensor]]:
    """Concatenate each tensor's rows from all ranks (first dimensions may differ per rank)."""
    return _allgather(GROUPED, tensors, name, process_set)


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet | None = None
) -> Handle[torch.Tensor]:
    """Start concatenating ``tensor``'s rows from all ranks along dim 0, in rank order."""
    return _allgather(PLAIN, [tensor], name, process_set)


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOpLike | None = None,
    process_set: ProcessSet | None = None,
) -> Handle[torch.Tensor]:
    """Average (or Sum) a sparse COO tensor across ranks, as Horovod does: the indices and values
    of every rank are allgathered and form one uncoalesced sparse tensor of the same shape."""
    op_name = resolve_op(op)
    if op_name not in ("Average", "Sum"):
        raise CollectiveArgumentError(
            f"sparse_allreduce_async supports Average and Sum, not {op_name}.\n"
            "HINT: densify the tensor (tensor.to_dense()) for other reductions."
        )
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise CollectiveArgumentError(
            f"sparse_allreduce_async expects a sparse COO tensor, got {type(tensor).__name__}"
            f"{' (dense)' if isinstance(tensor, torch.Tensor) else ''}.\n"
            "HINT: use allreduce_async for dense tensors."
        )
    t = tensor.detach().coalesce()
    ctl = controller_of(process_set)
    name = name if name is not None else ctl.auto_name("sparse_allreduce")
    size = ctl.comm.size
    # Allgather concatenates along dim 0: indices travel transposed, one row per entry.
    parts = [
        allgather_async(t.indices().t().contiguous(), f"{name}.indices", process_set),
        allgather_async(t.values().contiguous(), f"{name}.values", process_set),
    ]

    def build(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if op_name == "Average":
            values = values / size
        try:  # checked: indices come from peers, and one out of this shape corrupts memory
            return torch.sparse_coo_tensor(indices.t(), values, t.shape, check_invariants=True)
        except RuntimeError as e:
            raise ValueError(
                f"sparse_allreduce {name!r}: the ranks' indices do not fit this rank's shape "
                f"{tuple(t.shape)} ({e}).\nHINT: every rank must pass a tensor of one shape."
            ) from e

    return CompositeHandle(name, parts, build)


# ---- broadcast -------------------------------------------------------------------------------


def checked_root(root_rank: Any, ranks: Sequence[int]) -> tuple[int, str]:
    """``(root, "")`` for a valid root of a broadcast over the set ``ranks``, else ``(-1, why)``.
    As in Horovod, a root is a global rank (``rank()`` of the root), also on a process set, and
    must be a member. Ints, numpy and 0-d torch integers are accepted."""
    try:
        if isinstance(root_rank, bool):
            raise TypeError
        root = operator.index(root_rank)
    except TypeError:
        return -1, f"root_rank must be an int, got {type(root_rank).__name__}"
    if root not in ranks:
        return -1, (
            f"root_rank {root} is not a member of the process set (ranks {list(ranks)}).\n"
            "HINT: root_rank is a global rank (hvd.rank() of the root), as in Horovod, and must "
            "belong to the process set."
        )
    return root, ""


def _broadcast(
    variant: Variant,
    tensor: Any,
    root_rank: int,
    name: str | None,
    process_set: ProcessSet | None,
) -> Handle[Any]:
    [t] = _detached([tensor])
    inplace = variant.inplace
    outputs = [t if inplace else torch.empty_like(t)] if isinstance(t, torch.Tensor) else None
    root, error = checked_root(root_rank, controller_of(process_set).comm.ranks)
    error = error or (_written_error("broadcast", [t]) if inplace else "")

    def finish(result: list[torch.Tensor]) -> Any:
        # In place, the caller's own tensor comes back (the result is a view of it), as Horovod.
        return tensor if inplace and isinstance(tensor, torch.Tensor) else result[0]

    return _submit(
        "broadcast",
        [t],
        name,
        process_set,
        finish,
        outputs,
        lambda: error,
        root=root,
    )


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> Handle[torch.Tensor]:
    """Start copying ``root_rank``'s tensor to every rank; ``synchronize`` returns a new one."""
    return _broadcast(PLAIN, tensor, root_rank, name, process_set)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> Handle[torch.Tensor]:
    """In-place version of :func:`broadcast_async`: ``tensor`` receives the root's."""
    return _broadcast(IN_PLACE, tensor, root_rank, name, process_set)


# ---- reducescatter ---------------------------------------------------------------------------


def _reducescatter(
    variant: Variant,
    tensors: Sequence[Any],
    name: str | None,
    op: ReduceOpLike | None,
    process_set: ProcessSet | None,
    prescale_factor: float,
    postscale_factor: float,
) -> Handle[Any]:
    sent, op_name = _detached(tensors), resolve_op(op)
    pre, post = float(prescale_factor), float(postscale_factor)
    return _submit(
        "reducescatter",
        sent,
        name,
        process_set,
        variant.result,
        check=lambda: dtypes.refusal(sent, op_name, pre, post),
        op=op_name,
        prescale=pre,
        postscale=post,
    )


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: ReduceOpLike | None = None,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle[list[torch.Tensor]]:
    """Reduce, then give rank r its slice of dim 0 (the first ``rows % size`` ranks get one extra row)."""
    args = (name, op, process_set, prescale_factor, postscale_factor)
    return _reducescatter(GROUPED, tensors, *args)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOpLike | None = None,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle[torch.Tensor]:
    """Start reducing ``tensor`` over the ranks; ``synchronize`` returns this rank's slice."""
    args = (name, op, process_set, prescale_factor, postscale_factor)
    return _reducescatter(PLAIN, [tensor], *args)


# ---- alltoall --------------------------------------------------------------------------------


def _not_1d(splits: Any) -> bool:
    """Whether ``splits`` is anything but one whole number per entry."""
    if isinstance(splits, torch.Tensor):
        # A float tensor's 1.5 would be cut to 1 and its rows silently left unsent (Horovod
        # takes only int32 splits); bool is not a count either.
        whole = not (
            splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool
        )
        return splits.dim() != 1 or not whole
    try:
        for s in splits:
            operator.index(s)
    except TypeError:
        return True
    return False


def _splits_check(tensor: Any, splits: Any, process_set: ProcessSet | None) -> Callable[[], str]:
    def check() -> str:
        size = controller_of(process_set).comm.size
        rows = tensor.shape[0] if isinstance(tensor, torch.Tensor) and tensor.dim() else 0
        if splits is None:
            return (
                ""
                if rows % size == 0
                else (
                    f"alltoall without splits needs dim 0 ({rows}) divisible by the set size ({size}); pass splits="
                )
            )
        if _not_1d(splits):  # raised on every rank, as the checks below
            return (
                "alltoall splits must be a whole number of rows per rank (1-D), got "
                f"{splits!r}\nHINT: pass a list of ints or a 1-D integer tensor (e.g. torch.int32)."
            )
        if len(splits) != size:
            return f"alltoall splits has {len(splits)} entries, expected one per rank ({size})"
        if any(int(s) < 0 for s in splits) or sum(int(s) for s in splits) > rows:
            return (
                f"alltoall splits {list(splits)} must be >= 0 and sum to at most dim 0 of the "
                f"tensor ({rows}); rows past their sum are not sent"
            )
        return ""

    return check


def alltoall_async(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> Handle[tuple[torch.Tensor, torch.Tensor]]:
    """Send ``splits[r]`` rows to rank r; receive each rank's rows for us, in rank order.
    ``synchronize`` returns ``(output, received_splits)``, with or without ``splits``, as
    Horovod's does (only the sync :func:`alltoall` drops the splits when none were given)."""
    if isinstance(splits, torch.Tensor) and not _not_1d(splits):
        splits = [int(s) for s in splits.tolist()]
    split_tuple = () if splits is None or _not_1d(splits) else tuple(int(s) for s in splits)
    t = tensor.detach() if isinstance(tensor, torch.Tensor) else tensor
    return _submit(
        "alltoall",
        [t],
        name,
        process_set,
        tuple,
        None,
        _splits_check(t, splits, process_set),
        splits=split_tuple,
    )
