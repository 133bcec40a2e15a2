"""Copies and scalings on the collective path, on the calling thread alone (no OpenMP team).

Packing tensors into a fusion buffer, unpacking them, the fast lane's backup of a tensor and
its restoration, an Average's scaling and the rank-ordered sums
(:mod:`~ringtrain.collectives.ordered`) all run while Gloo's threads move data. A torch op
over more than ``GRAIN`` elements of a CPU tensor runs as an OpenMP parallel region, and after
a region libgomp's workers spin (its default wait policy) for milliseconds on the cores that
Gloo's threads need: at 8 ranks a 1 MiB allreduce whose lane took one parallel clone per op
ran at 0.15x raw Gloo's speed, 0.82x with ``OMP_WAIT_POLICY=PASSIVE``. Each thread that starts
a region also keeps its own team of workers.

So the ops here are split into views of at most ``GRAIN`` elements, which torch runs serially
by its own rule (``at::internal::GRAIN_SIZE``), and handed to one ``torch._foreach_*`` call
(on the CPU a loop in C++ over the pieces). Nothing global changes: ``torch.set_num_threads(1)``
around the copy would also set the thread count that every thread started later inherits, and
race with a user who sets it meanwhile; libgomp's per-thread ``omp_set_num_threads`` is cheaper
but reaches past torch into whichever OpenMP runtime it was built with. Same-dtype copies move
as 8-byte words where the bytes allow, so a piece is 256 KiB whatever the dtype; the pieces cost
about 3 us each, 10-20% of a copy that stays in cache, less of one that does not.
``tests/collectives/test_copies.py`` checks that no worker thread starts.
"""

from __future__ import annotations

import torch

from ringtrain.compression import averaging

# torch's grain size (at::internal::GRAIN_SIZE, not exported to Python): an elementwise op over
# at most this many elements runs on the calling thread.
GRAIN = 32768
_WORD = torch.int64


def copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` on this thread alone (``dst`` and ``src`` of the same shape)."""
    if dst.numel() <= GRAIN:
        dst.copy_(src)
        return
    copy_all_([dst], [src])


def copy_all_(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair, on this thread alone, in one call into torch."""
    to: list[torch.Tensor] = []
    frm: list[torch.Tensor] = []
    for d, s in zip(dsts, srcs):
        if d.numel() <= GRAIN:
            to.append(d)
            frm.append(s)
            continue
        pieces = _pieces(d, s)
        if pieces is None:  # not one dense block: torch's own copy (rare on this path)
            d.copy_(s)
            continue
        to += pieces[0]
        frm += pieces[1]
    if to:
        torch._foreach_copy_(to, frm)


def scale_(t: torch.Tensor, factor: float) -> None:
    """``t *= factor`` as :func:`ringtrain.compression.averaging.scale`, on this thread alone
    for a dense floating-point tensor (integers are scaled through doubles there)."""
    if factor == 1.0:
        return
    if t.numel() <= GRAIN or not t.is_floating_point() or not t.is_contiguous():
        averaging.scale(t, factor)
        return
    torch._foreach_mul_(list(t.view(-1).split(GRAIN)), factor)


def add_(acc: torch.Tensor, other: torch.Tensor) -> None:
    """``acc += other`` elementwise (both 1-D, dense, alike), on this thread alone."""
    torch._foreach_add_(list(acc.split(GRAIN)), list(other.split(GRAIN)))


def mul_(acc: torch.Tensor, other: torch.Tensor) -> None:
    """``acc *= other`` elementwise (both 1-D, dense, alike), on this thread alone."""
    torch._foreach_mul_(list(acc.split(GRAIN)), list(other.split(GRAIN)))


def _pieces(
    d: torch.Tensor, s: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None:
    """``d`` and ``s`` as matching views of at most ``GRAIN`` elements; None if either is not
    one dense block."""
    if not (d.is_contiguous() and s.is_contiguous()) or d.numel() != s.numel():
        return None
    d, s = d.view(-1), s.view(-1)
    if d.dtype == s.dtype and d.dtype != _WORD and _wordy(d) and _wordy(s):
        d, s = d.view(_WORD), s.view(_WORD)  # a bit-exact copy either way, in fewer pieces
    return d.split(GRAIN), s.split(GRAIN)


def _wordy(t: torch.Tensor) -> bool:
    """Whether a flat dense tensor can be viewed as 8-byte words."""
    size = t.element_size()
    return (t.numel() * size) % 8 == 0 and (t.storage_offset() * size) % 8 == 0
