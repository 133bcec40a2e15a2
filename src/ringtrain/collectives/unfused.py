"""The collectives run one request at a time: broadcast, allgather, alltoall and reducescatter.

The executor (:mod:`ringtrain.collectives.execute`) fuses allreduces; every other kind runs here,
one call per request, on the process set's data groups. Data movement (broadcast, allgather,
alltoall) travels as raw bytes, which is exact for every dtype and lets ranks exchange tensors
of any shape in one call; small broadcasts and allgathers whose data came with the negotiation
(:mod:`ringtrain.collectives.inline`) are completed from it with no collective. A reducescatter
on a Gloo group goes around ringtrain's own ring (half the bytes of Gloo's), with the sum's
order fixed by rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ringtrain.collectives import dtypes, inline
from ringtrain.collectives.requests import Request, TensorMeta
from ringtrain.collectives.scaling import REDUCE_OPS, scaling_of
from ringtrain.errors import CollectiveMismatchError
from ringtrain.runtime.communicator import Communicator
from ringtrain.transport import group_ops


def zeros(meta: TensorMeta) -> torch.Tensor:
    return torch.zeros(meta.shape, dtype=dtypes.from_name(meta.dtype), device=meta.device)


def _ring_reduces_scatter(pieces: torch.Tensor, group: Any) -> bool:
    """Whether a reducescatter of ``pieces`` (one equal chunk per rank) goes around ringtrain's
    ring: host memory on a Gloo group (sealed and TCP groups run their own ring already), and
    some data to move."""
    return not pieces.is_cuda and pieces.numel() > 0 and group_ops.backend(group) == "gloo"


def broadcast(
    comm: Communicator,
    req: Request,
    by_rank: Mapping[int, Request],
    tensors: list[torch.Tensor],
    outputs: list[torch.Tensor],
    root: int,
    me: int,
    root_data: inline.Payload | None = None,
) -> list[torch.Tensor]:
    """``root``: the root's set rank; ``root_data``: its tensors, sent inline with the
    negotiation."""
    root_req = by_rank[root]
    results = []
    offset = 0
    for i, meta in enumerate(root_req.tensors):
        if me == root:
            out = outputs[i] if outputs else tensors[i]
            if out is not tensors[i]:
                out.copy_(tensors[i])
        elif req.shape_from_root or not outputs:
            out = zeros(meta)
        else:
            out = outputs[i]
        buf = dtypes.as_bytes(out)
        if root_data is not None:
            if me != root:
                inline.take(root_data, offset, buf)
            offset += buf.numel()
        elif comm.size > 1:
            group_ops.broadcast(buf, comm.group_for(buf), root)
        if buf.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
            out.copy_(
                buf.view(out.dtype if out.dtype != torch.bool else torch.uint8).view(out.shape)
            )
        results.append(out)
    return results


def allgather(
    comm: Communicator,
    i: int,
    t: torch.Tensor,
    by_rank: Mapping[int, Request],
    pieces: Mapping[int, list[bytes]] | None = None,
) -> torch.Tensor:
    """``pieces``: every rank's tensors as raw bytes, when they came with the negotiation."""
    meta = by_rank[min(by_rank)].tensors[i]
    rows = [
        by_rank[r].tensors[i].shape[0] if by_rank[r].tensors[i].shape else 1
        for r in range(comm.size)
    ]
    if t.dim() == 0:
        t = t.reshape(1)
    data = dtypes.as_bytes(t)
    width = data.shape[1]
    longest = max(rows)
    if pieces is not None:
        raw = b"".join(pieces[r][i] for r in sorted(pieces))
        if len(raw) != sum(rows) * width:  # only with consistency checks off
            raise CollectiveMismatchError(
                f"allgather {by_rank[min(by_rank)].name!r}: ranks sent rows of different "
                "sizes.\nHINT: every rank must pass tensors of the same dtype and trailing "
                "shape (only the first dimension may differ)."
            )
        gathered = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(sum(rows), width)
            if raw
            else torch.empty((sum(rows), width), dtype=torch.uint8)
        )
    elif comm.size == 1:
        gathered = data
    else:
        padded = data
        if data.shape[0] != longest:
            padded = torch.zeros((longest, width), dtype=torch.uint8, device=data.device)
            padded[: data.shape[0]] = data
        parts = [torch.empty_like(padded) for _ in range(comm.size)]
        group_ops.all_gather(parts, padded, comm.group_for(padded))
        gathered = torch.cat([p[:k] for p, k in zip(parts, rows)])
    dtype = dtypes.from_name(meta.dtype)
    tail = tuple(meta.shape[1:]) if meta.shape else ()
    return _from_bytes(gathered, dtype, (sum(rows), *tail))


def reducescatter(comm: Communicator, req: Request, t: torch.Tensor) -> torch.Tensor:
    size, me = comm.size, comm.set_rank
    rows = t.shape[0]
    counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
    work = dtypes.to_reducible(t, req.op).reshape(rows, math.prod(t.shape[1:]))
    longest = max(counts)
    width = work.shape[1]
    pieces = torch.zeros((size, longest, width), dtype=work.dtype, device=work.device)
    offset = 0
    for r, k in enumerate(counts):
        pieces[r, :k] = work[offset : offset + k]
        offset += k
    scaling = scaling_of(req, size, work.dtype)  # integers as Horovod: see scaling_of
    scaling.before(pieces)
    if size == 1 or pieces.numel() == 0:  # no data: every rank's shape is the same (checked)
        out = pieces[0]
    elif _ring_reduces_scatter(pieces, group := comm.group_for(pieces)):
        # Gloo's reduce_scatter allreduces the whole input and keeps a chunk: twice the
        # bytes. Around a ring each rank sends every other rank's chunk once; the sums'
        # order is fixed by rank (not timing), as Gloo's is.
        mine = group_ops.ring_reduce_scatter(
            pieces.view(size, -1).unbind(0), group, REDUCE_OPS[req.op]
        )
        out = pieces[mine].clone()  # a view would keep every rank's chunk alive
    else:
        out = torch.empty((longest, width), dtype=work.dtype, device=work.device)
        flat = pieces.reshape(size * longest, width)
        group_ops.reduce_scatter_into(out, flat, group, REDUCE_OPS[req.op])
    out = out[: counts[me]]
    scaling.after(out)
    result = out.reshape((counts[me], *t.shape[1:]))
    if t.dtype == torch.uint64:
        return result.view(torch.uint64)
    return result.to(t.dtype)


def alltoall(
    comm: Communicator, by_rank: Mapping[int, Request], t: torch.Tensor, me: int
) -> tuple[torch.Tensor, torch.Tensor]:
    size = comm.size

    def splits_of(r: int) -> list[int]:
        req = by_rank[r]
        if req.splits:
            return list(req.splits)
        rows = req.tensors[0].shape[0] if req.tensors[0].shape else 1
        return [rows // size] * size

    send = splits_of(me)
    recv = [splits_of(r)[me] for r in range(size)]
    if t.dim() == 0:
        t = t.reshape(1)
    data = dtypes.as_bytes(t)[: sum(send)]  # splits may leave rows unsent, as in Horovod
    out = torch.empty((sum(recv), data.shape[1]), dtype=torch.uint8, device=data.device)
    if size > 1:
        group_ops.finish(group_ops.all_to_all(out, data, recv, send, comm.group_for(data)), out)
    else:
        out.copy_(data)
    result = _from_bytes(out, t.dtype, (sum(recv), *t.shape[1:]))
    return result, torch.tensor(recv, dtype=torch.int32)


def _from_bytes(data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if data.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=data.device)
    flat = data.reshape(-1)
    if dtype == torch.bool:
        return flat.view(torch.bool).reshape(shape)
    return flat.view(dtype).reshape(shape)
