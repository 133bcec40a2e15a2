"""Sparse gradients in the exchange: allgathered (indices and values, padded to the largest
count) and summed locally, never compressed. Launched at ``flush()``, after the dense buckets,
on the engine group (:class:`ringtrain.engine.exchange.GradientExchange`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringtrain.runtime import abort
from ringtrain.transport import group_ops


def launch(
    indices_of: Sequence[int], params: Sequence[torch.nn.Parameter], group: Any, size: int
) -> list[Any]:
    """Start the all-gathers of the sparse gradients of ``params[i]`` for ``i`` in
    ``indices_of``; :func:`finish` completes them."""
    local = []
    for i in indices_of:
        p = params[i]
        g = p.grad
        if g is None:
            indices = torch.zeros((1, 0), dtype=torch.int64, device=p.device)
            values = torch.zeros((0, *p.shape[1:]), dtype=p.dtype, device=p.device)
        else:
            if not g.is_sparse:
                g = g.to_sparse(1)
            elif g.sparse_dim() != 1:
                g = g.to_dense().to_sparse(1)
            g = g.coalesce()
            indices, values = g.indices(), g.values()
        local.append((indices, values))
    counts = torch.tensor([v.shape[0] for _, v in local], dtype=torch.int64)
    every = torch.empty(size * counts.numel(), dtype=torch.int64)
    group_ops.all_gather_into(every, counts, group)
    table = every.view(size, -1)
    works = []
    for j, (indices, values) in enumerate(local):
        rows = table[:, j].tolist()
        longest = max(rows)
        pad_i = torch.zeros((1, longest), dtype=indices.dtype, device=indices.device)
        pad_i[:, : indices.shape[1]] = indices
        pad_v = torch.zeros((longest, *values.shape[1:]), dtype=values.dtype, device=values.device)
        pad_v[: values.shape[0]] = values
        out_i = [torch.empty_like(pad_i) for _ in range(size)]
        out_v = [torch.empty_like(pad_v) for _ in range(size)]
        wi = group_ops.all_gather(out_i, pad_i, group, async_op=True)
        wv = group_ops.all_gather(out_v, pad_v, group, async_op=True)
        works.append((rows, out_i, out_v, wi, wv))
    return works


def finish(
    indices_of: Sequence[int],
    params: Sequence[torch.nn.Parameter],
    works: list[Any],
    scale: float,
) -> None:
    """Wait for :func:`launch`'s all-gathers; each ``.grad`` becomes the sum times ``scale``."""
    for i, (rows, out_i, out_v, wi, wv) in zip(indices_of, works):
        abort.wait_work(wi)
        abort.wait_work(wv)
        p = params[i]
        indices = torch.cat([t[:, :n] for t, n in zip(out_i, rows)], dim=1)
        values = torch.cat([t[:n] for t, n in zip(out_v, rows)]) * scale
        p.grad = torch.sparse_coo_tensor(indices, values, p.shape).coalesce()
