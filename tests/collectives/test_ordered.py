"""Deterministic fusion at 3 ranks (collectives/ordered.py): async bursts fuse into a few Gloo
ops, and every element sums in rank order, ``(x0 + x1) + x2``, however the ops were batched."""

from __future__ import annotations

import random
import time

import pytest
import torch

import ringtrain as rt
from ringtrain.collectives import ordered
from ringtrain.testing import spawn

TIMEOUT = 240
BURST = 256
EACH = 16384  # 64 KiB of float32


def _data(i: int, rank: int, numel: int = EACH, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * i + rank)
    x = torch.randn(numel, generator=g, dtype=torch.float64) * 10.0 ** (i % 7 - 3)
    if dtype.is_complex:
        return torch.complex(x, x.flip(0)).to(dtype)
    return x.to(dtype)


def _in_rank_order(i: int, numel: int = EACH, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What every rank must get: the ranks' values added one by one, rank 0 first."""
    acc = _data(i, 0, numel, dtype)
    for r in range(1, rt.size()):
        acc = acc + _data(i, r, numel, dtype)
    return acc


def _fused_ops() -> int:
    return int(rt.global_process_set.communicator.service("controller")._executor.fused_ops)


def _burst(delay_seed: int | None) -> tuple[list[bool], int]:
    """A burst of async allreduces then synchronize, three times; rank 1 pauses at random
    points (another pattern per seed), so rounds cut the burst differently every time."""
    pause = random.Random(delay_seed)
    data = [_data(i, rt.rank()) for i in range(BURST)]
    expected = [_in_rank_order(i) for i in range(BURST)]
    same: list[bool] = []
    before = _fused_ops()
    for _ in range(3):
        work = [t.clone() for t in data]
        handles = []
        for i, t in enumerate(work):
            if delay_seed is not None and rt.rank() == 1 and pause.random() < 0.05:
                time.sleep(pause.uniform(0.001, 0.02))
            handles.append(rt.allreduce_async_(t, name=f"burst.{i}", op=rt.Sum))
        for h in handles:
            rt.synchronize(h)
        same.append(all(torch.equal(w, e) for w, e in zip(work, expected)))
    return same, _fused_ops() - before


@pytest.mark.timeout(TIMEOUT)
def test_an_async_burst_fuses_and_sums_in_rank_order(world3: spawn.World) -> None:
    for seed in (None, 1, 2):
        results = world3.run(_burst, seed, timeout=TIMEOUT)
        for same, ops in results:
            assert same == [True, True, True], seed  # the same bits, whatever the timing
            # 3 bursts of 256 ops: each fused into one or a few Gloo ops (without the rank
            # order, each op was a Gloo call of its own: 768).
            assert ops <= 3 * 16, (seed, ops)


def _shapes_and_dtypes() -> list[bool]:
    """Grouped calls (one fused buffer, sizes that do not divide by 3), in place and not, a
    tensor reduced where it lies, 16-bit floats and a product: every element in rank order."""
    r = rt.rank()
    out: list[bool] = []
    numels = [5001, 1, 70_001, 3, 1024]
    got = rt.grouped_allreduce([_data(i, r, n) for i, n in enumerate(numels)], op=rt.Sum)
    out += [torch.equal(g, _in_rank_order(i, n)) for i, (g, n) in enumerate(zip(got, numels))]
    half = [_data(i, r, n, torch.float16) for i, n in enumerate(numels)]
    rt.grouped_allreduce_(half, op=rt.Sum)
    out += [
        torch.equal(h, _in_rank_order(i, n, torch.float16))
        for i, (h, n) in enumerate(zip(half, numels))
    ]
    for dtype in (torch.bfloat16, torch.complex64):  # bytes on the wire: every dtype moves
        t = _data(8, r, 30_001, dtype)
        rt.allreduce_(t, op=rt.Sum, name=f"bytes.{dtype}")
        out.append(torch.equal(t, _in_rank_order(8, 30_001, dtype)))
    one = _data(9, r, 100_003, torch.float64)
    rt.allreduce_(one, op=rt.Sum, name="one")
    out.append(torch.equal(one, _in_rank_order(9, 100_003, torch.float64)))
    factors = [1.0 + _data(i, r, 2000, torch.float64) * 1e-3 for i in range(3)]
    prod = rt.grouped_allreduce(factors, op=rt.Product)
    for i, p in enumerate(prod):
        acc = 1.0 + _data(i, 0, 2000, torch.float64) * 1e-3
        for k in range(1, rt.size()):
            acc = acc * (1.0 + _data(i, k, 2000, torch.float64) * 1e-3)
        out.append(torch.equal(p, acc))
    return out


@pytest.mark.timeout(TIMEOUT)
def test_every_path_sums_in_rank_order(world3: spawn.World) -> None:
    for flags in world3.run(_shapes_and_dtypes, timeout=TIMEOUT):
        assert all(flags), flags


def test_which_reductions_take_the_rank_order() -> None:
    assert ordered.needed("Sum", torch.float32, 3)
    assert ordered.needed("Average", torch.bfloat16, 4)
    assert ordered.needed("Product", torch.float64, 3)
    assert not ordered.needed("Sum", torch.float32, 2)  # a + b == b + a
    assert not ordered.needed("Sum", torch.int64, 3)  # integer sums are exact in any order
    assert not ordered.needed("Max", torch.float32, 3)  # picks a value


def _in_pieces() -> list[bool]:
    """With ``ordered.PIECE_BYTES`` set (pieces pipelined, an experiment): sums and products of
    sizes that do not divide into pieces or ranks, and buffers of fewer elements than ranks, in
    rank order; then an async burst, fused and summed in pieces."""
    r = rt.rank()
    comm = rt.global_process_set.communicator
    scratch = ordered.Scratch()
    before, ordered.PIECE_BYTES = ordered.PIECE_BYTES, 64 * 1024
    try:
        out = []
        for i, (numel, dtype) in enumerate(
            [(100_003, torch.float32), (16_385, torch.float64), (2, torch.float32)]
        ):
            t = _data(i, r, numel, dtype)
            ordered.allreduce(t, "Sum", comm.group_for(t), scratch)
            out.append(torch.equal(t, _in_rank_order(i, numel, dtype)))
        factors = 1.0 + _data(5, r, 50_001, torch.float64) * 1e-3
        ordered.allreduce(factors, "Product", comm.group_for(factors), scratch)
        acc = 1.0 + _data(5, 0, 50_001, torch.float64) * 1e-3
        for k in range(1, rt.size()):
            acc = acc * (1.0 + _data(5, k, 50_001, torch.float64) * 1e-3)
        out.append(torch.equal(factors, acc))
        same, _ = _burst(None)
        return out + same
    finally:
        ordered.PIECE_BYTES = before


@pytest.mark.timeout(TIMEOUT)
def test_pieces_sum_in_rank_order(world3: spawn.World) -> None:
    for flags in world3.run(_in_pieces, timeout=TIMEOUT):
        assert all(flags), flags


LARGE = (ordered.ALONE_ABOVE_BYTES // 4) + 1  # float32 elements: just above the limit


def _large_ops_alone_on_the_ring() -> tuple[bool, bool, int]:
    """Above ALONE_ABOVE_BYTES an op reduces alone on Gloo's ring (the rank-ordered sum costs
    2-3x its wall time there): its bits are torch's all_reduce of the same tensor, every time,
    async or not, and it shares no buffer with the small ops around it."""
    import torch.distributed as dist

    r = rt.rank()
    ring = _data(1, r, LARGE)
    dist.all_reduce(ring, group=rt.global_process_set.communicator.group("cpu"))
    before = _fused_ops()
    big = _data(1, r, LARGE)
    small = [_data(2 + i, r) for i in range(4)]
    handles = [rt.allreduce_async_(t, name=f"small.{i}", op=rt.Sum) for i, t in enumerate(small)]
    handles.insert(2, rt.allreduce_async_(big, name="large", op=rt.Sum))
    for h in handles:
        rt.synchronize(h)
    sync = rt.allreduce(_data(1, r, LARGE), name="large.sync", op=rt.Sum)
    smalls_in_order = all(torch.equal(s, _in_rank_order(2 + i)) for i, s in enumerate(small))
    return (
        torch.equal(big, ring) and torch.equal(sync, ring),
        smalls_in_order,
        _fused_ops() - before,
    )


def test_a_large_op_reduces_alone_on_the_ring(world3: spawn.World) -> None:
    for same_as_ring, smalls_in_order, ops in world3.run(
        _large_ops_alone_on_the_ring, timeout=TIMEOUT
    ):
        assert same_as_ring and smalls_in_order
        assert ops >= 3  # the large ones alone; the small ones before and after it apart


def test_large_ops_go_alone() -> None:
    assert not ordered.alone(ordered.ALONE_ABOVE_BYTES)
    assert ordered.alone(ordered.ALONE_ABOVE_BYTES + 1)
