"""Sparse gradients in the exchange: the :class:`~ringtrain.compression.sparse.SparseRows` codec
(values and indices, all-gathered and summed locally, never compressed), launched at
``flush()``, after the dense buckets, on the engine group's rounds
(:class:`ringtrain.engine.exchange.GradientExchange`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringtrain import transport
from ringtrain.compression.sparse import SparseRows

_CODEC = SparseRows()


def launch(
    indices_of: Sequence[int],
    params: Sequence[torch.nn.Parameter],
    group: Any,
    scale: float = 1.0,
) -> list[Any]:
    """Start the all-gathers of the sparse gradients of ``params[i]`` for ``i`` in
    ``indices_of``, each scaled by ``scale`` first (this rank's weight under batch_shares);
    :func:`finish` completes them."""
    members = [params[i] for i in indices_of]
    if scale != 1.0:
        with torch.no_grad():
            for p in members:
                if p.grad is not None:
                    p.grad = p.grad * scale
    return _CODEC.launch(members, transport.rounds(group))


def finish(
    indices_of: Sequence[int],
    params: Sequence[torch.nn.Parameter],
    works: list[Any],
    scale: float,
) -> None:
    """Wait for :func:`launch`'s all-gathers; each ``.grad`` becomes the sum times ``scale``."""
    members = [params[i] for i in indices_of]
    for p, g in zip(members, _CODEC.finish(members, works, scale)):
        p.grad = g
