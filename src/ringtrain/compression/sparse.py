"""Sparse gradients (``nn.Embedding(sparse=True)``) travel as values and indices.

Every rank's rows (indices and values, padded to the largest count) are all-gathered and summed
locally, in rank order, so every rank gets the same result; never compressed. Two phases, so the
gathers run while dense buckets finish: :meth:`SparseRows.launch` (the counts, then every
gradient's two all-gathers, asynchronous) and :meth:`SparseRows.finish` (the sums, times the
average's factor). Its rounds go through the :class:`~ringtrain.compression.codec.Rounds` it is
handed, like every codec's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringtrain.compression.codec import Rounds


class SparseRows:
    """The codec of sparse gradients: rows gathered from every rank, summed on each."""

    name = "sparse"
    own_rounds = True

    def launch(self, params: Sequence[torch.Tensor], rounds: Rounds) -> list[Any]:
        """Start the all-gathers of every ``params[i].grad`` (sparse, dense or None: zeros)."""
        size = rounds.size
        local = []
        for p in params:
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
        rounds.all_gather_into(every, counts).wait()
        table = every.view(size, -1)
        works = []
        for j, (indices, values) in enumerate(local):
            rows = table[:, j].tolist()
            longest = max(rows)
            pad_i = torch.zeros((1, longest), dtype=indices.dtype, device=indices.device)
            pad_i[:, : indices.shape[1]] = indices
            pad_v = torch.zeros(
                (longest, *values.shape[1:]), dtype=values.dtype, device=values.device
            )
            pad_v[: values.shape[0]] = values
            out_i = [torch.empty_like(pad_i) for _ in range(size)]
            out_v = [torch.empty_like(pad_v) for _ in range(size)]
            wi = rounds.all_gather(out_i, pad_i)
            wv = rounds.all_gather(out_v, pad_v)
            works.append((rows, out_i, out_v, wi, wv))
        return works

    def finish(
        self, params: Sequence[torch.Tensor], works: list[Any], scale: float
    ) -> list[torch.Tensor]:
        """Wait for :meth:`launch`'s all-gathers: every parameter's summed gradient (sparse),
        times ``scale``."""
        out = []
        for p, (rows, out_i, out_v, wi, wv) in zip(params, works):
            wi.wait()
            wv.wait()
            indices = torch.cat([t[:, :n] for t, n in zip(out_i, rows)], dim=1)
            values = torch.cat([t[:n] for t, n in zip(out_v, rows)]) * scale
            # Checked: indices come from peers, and one out of this shape would corrupt memory.
            out.append(
                torch.sparse_coo_tensor(indices, values, p.shape, check_invariants=True).coalesce()
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
